"""The documents stay true to the code: every config key is documented, every setting they write loads, and
links between them resolve."""

import dataclasses
import re
import shutil
from pathlib import Path

from conftest import readme_blocks
from tformer_cli.config import SECTIONS
from tformer_cli.run_folder import step_checkpoints

ROOT = Path(__file__).resolve().parent.parent


def test_the_config_reference_is_the_table_generated_from_the_dataclasses():
    from tformer_cli.config_doc import key_table

    table = key_table()
    assert table in (ROOT / "docs" / "config.md").read_text(), "run python -m tformer_cli.config_doc"
    keys = [line.split("`")[1] for line in table.splitlines()[2:]]
    fields = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert keys == fields  # every key, once
    assert all(not line.endswith("|  |") for line in table.splitlines()), "a config field without a comment"


def test_links_between_the_documents_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


def test_every_setting_the_documents_write_loads_as_written():
    """`train.accel: off` and `--set train.accel=off` in prose are settings a user copies: each must load
    (YAML read that `off` as false, and the config refused it)."""
    from tformer_cli.config import load_config

    written = re.compile(r"`((?:model|data|train|decode)\.\w+): ([^`]+)`"  # `train.accel: off`
                         r"|--set[ =]['\"]?((?:model|data|train|decode)\.[\w.]+)=([^\s`'\"]+)")  # --set train.x=1
    settings = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        for match in written.finditer(doc.read_text()):
            key, value = match.group(1) or match.group(3), match.group(2) or match.group(4)
            if value not in ("...", "value"):  # placeholders (`--set model.key=value`)
                settings.add((key, value))
    assert ("train.accel", "off") in settings and len(settings) > 20
    for key, value in sorted(settings):
        load_config(ROOT / "configs" / "demo.yaml", [f"{key}={value}"])  # raises ConfigError, naming it


def _readme_commands() -> list[str]:
    """The `tformer` commands of the README's bash blocks that run on a finished run or need none
    (training and installing are left to the demo, CI and the tests of train)."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()
            if command.startswith("tformer ") and not command.startswith("tformer train"):
                commands.append(command)
    return commands


def test_the_readme_commands_run_as_written_on_a_run(trained_run, tmp_path, monkeypatch):
    import shlex

    from typer.testing import CliRunner

    from tformer_cli.cli import app

    commands = _readme_commands()
    assert {c.split()[1] for c in commands} == {"eval", "generate", "inspect-attention", "count-params", "average",
                                                "plot", "export"}
    monkeypatch.chdir(tmp_path)  # files the commands write land here
    for name in ("demo", "demo-seed2", "multi30k"):  # the README's run names, played by copies of the test's tiny run
        shutil.copytree(trained_run, tmp_path / "runs" / name)
    last = step_checkpoints(tmp_path / "runs" / "multi30k")[-1]
    for step in range(1, 6):  # enough checkpoints for `average --last 5`
        shutil.copytree(last, last.parent / f"step-{step:08d}", dirs_exist_ok=True)
    for command in commands:
        result = CliRunner().invoke(app, shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)


def test_the_readme_shows_what_a_config_mistake_prints(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tformer_cli.cli import app

    (console,) = [block for block in readme_blocks("console") if "bad.yaml" in block]
    command, *expected = console.strip().splitlines()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("model:\n  num_head: 8\ntrain:\n  schedule: cosin\n")
    result = CliRunner().invoke(app, command.removeprefix("$ tformer ").split())
    assert result.exit_code != 0 and result.output.splitlines() == expected
