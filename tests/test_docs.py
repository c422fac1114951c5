"""The documents stay true to the code: every config key is documented, every setting they write loads, and
links between them resolve."""

import dataclasses
import re
import shutil
from pathlib import Path

from tformer_cli.config import SECTIONS
from tformer_cli.runtime import step_checkpoints

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


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _readme_commands() -> list[str]:
    """The `tformer` commands of the README's bash blocks that run on a finished run or need none
    (training and installing are left to the demo, CI and the tests of train)."""
    commands = []
    for block in _blocks("bash"):
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

    (console,) = [block for block in _blocks("console") if "bad.yaml" in block]
    command, *expected = console.strip().splitlines()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("model:\n  num_head: 8\ntrain:\n  schedule: cosin\n")
    result = CliRunner().invoke(app, command.removeprefix("$ tformer ").split())
    assert result.exit_code != 0 and result.output.splitlines() == expected


# python3 -m venv DIR, standing in for Python: a venv whose pip writes down the arguments of each call
FAKE_PYTHON = """#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 2
mkdir -p "$3/bin"
printf '#!/bin/sh\\nprintf "%%s\\\\n" "$@" "" >> "$(dirname "$0")/pip.log"\\n' > "$3/bin/pip"
chmod +x "$3/bin/pip"
"""


def _pip_calls(tmp_path: Path, settings: list[str]) -> list[list[str]]:
    """The pip commands that `make install SETTINGS` runs in a venv of its own (each one's arguments),
    since the last call of this function."""
    import subprocess

    python, venv = tmp_path / "python", tmp_path / "venv"
    tmp_path.mkdir(exist_ok=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    subprocess.run(["make", "-C", str(ROOT), "install", f"PYTHON={python}", f"VENV={venv}", *settings],
                   check=True, capture_output=True)
    log = venv / "bin" / "pip.log"
    calls = log.read_text().split("\n\n")[:-1] if log.exists() else []
    log.unlink(missing_ok=True)
    return [call.split("\n") for call in calls]


def test_the_readme_install_lines_give_pip_a_requirement_and_options_and_a_new_torch_reinstalls(tmp_path):
    """`make install TORCH="torch==2.13.0 --index-url URL"` (the README's line until 2026-12-01) passed pip
    one requirement with spaces in it, which pip refuses; and a venv made with one build of torch kept it
    when asked for another, since 2.13.0+cpu meets torch==2.13.0."""
    import shlex

    lines = [line.split("  #")[0] for block in _blocks("bash") for line in block.splitlines()
             if line.startswith("make install")]
    assert len(lines) == 2  # the default build and another
    for n, line in enumerate(lines):
        settings, folder = shlex.split(line)[2:], tmp_path / str(n)
        calls = _pip_calls(folder, settings)
        torch_call, = [call for call in calls if any(arg.startswith("torch") for arg in call)]
        index = dict(setting.split("=", 1) for setting in settings).get("TORCH_INDEX")
        assert index or not settings
        assert torch_call == ["install", "--quiet", "torch==2.13.0", *(["--index-url", index] if index else [])]
        assert calls[-1] == ["install", "--quiet", "-e", ".[dev]"]
        assert _pip_calls(folder, settings) == []  # installed: nothing to do
        if index:  # the same venv asked for the default build: reinstalled over this one
            assert ["install", "--quiet", "--force-reinstall", "torch==2.13.0"] in _pip_calls(folder, [])
