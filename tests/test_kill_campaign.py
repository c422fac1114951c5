"""The kill campaign (benchmarks/kill_campaign.py) in small: one stop per signal. Minutes long, so marked
slow: `pytest -m slow`. The full campaign's figures are in benchmarks/README.md."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_signal_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kill_campaign.py"), "--kills", "1",
                             "--steps", "30", "--json", str(tmp_path / "kills.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("KILL", "INT", "TERM"):
        assert f"SIG{name}: 1 of 1 resumed to the same weights" in result.stdout
