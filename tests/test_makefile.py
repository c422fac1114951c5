"""The Makefile's targets as a user runs them: `make install` (with the README's lines) and `make clean`,
each in a folder of its own, with a stand-in Python where a real one would install packages."""

import shlex
import shutil
import subprocess
from pathlib import Path

from conftest import readme_blocks

ROOT = Path(__file__).resolve().parent.parent


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
    lines = [line.split("  #")[0] for block in readme_blocks("bash") for line in block.splitlines()
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


def test_make_clean_removes_the_venv_and_caches_and_keeps_the_trained_runs(tmp_path):
    """`make clean` deleted runs/ too, where make demo, make multi30k and tformer train (by default) put
    their models: an hour's training lost to a command that sounds like tidying up."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    made = [".venv/bin/pip", ".pytest_cache/README.md", "tformer_cli/__pycache__/cli.cpython-311.pyc"]
    kept = ["runs/demo/model.safetensors", "runs/multi30k-de-en/checkpoints/step-00001000/model.safetensors",
            "tformer_cli/cli.py"]
    for name in made + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    subprocess.run(["make", "-C", str(tmp_path), "clean"], check=True, capture_output=True)
    assert [name for name in made + kept if (tmp_path / name).exists()] == kept
    assert not (tmp_path / ".venv").exists()
