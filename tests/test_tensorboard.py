"""train.tensorboard: the figures of metrics.jsonl, read back from TensorBoard's event files."""

import pytest
from typer.testing import CliRunner

from conftest import write_config
from tformer_cli.cli import app
from tformer_cli.errors import UsageError
from tformer_cli.files import read_jsonl
from tformer_cli.tensorboard import SCALARS, check_available

runner = CliRunner()


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(run_dir):
    expected = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        for (split, key), tag in SCALARS.items():
            if record["split"] == split and record.get(key) is not None:
                expected.setdefault(tag, []).append((record["step"], record[key]))
    return expected


def _assert_same(run_dir):
    scalars, expected = _scalars(run_dir), _expected(run_dir)
    on_cpu = set(SCALARS.values()) - {"train/gpu_peak_mib"}  # a CPU run has no GPU memory to log
    assert set(scalars) == set(expected) == on_cpu
    for tag, points in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag  # each step once, in order
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag


def test_tensorboard_logs_what_metrics_jsonl_logs_and_a_resume_does_not_repeat_steps(tmp_path):
    config = write_config(tmp_path / "tb.yaml", train={"max_steps": 6, "eval_every": 3, "save_every": 3,
                                                       "tensorboard": True})
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(config), "--output-dir", str(run_dir), "--quiet"])
    assert result.exit_code == 0, result.output
    _assert_same(run_dir)
    # resumed from step 3, the run logs steps 4-6 again, then goes on to 9: TensorBoard keeps one of each
    (run_dir / "checkpoints" / "step-00000006").rename(tmp_path / "later-checkpoint")
    resumed = runner.invoke(app, ["train", "--resume", str(run_dir), "--set", "train.max_steps=9", "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    _assert_same(run_dir)
    assert _scalars(run_dir)["train/loss"][-1][0] == 9
    again = runner.invoke(app, ["train", str(config), "--output-dir", str(run_dir), "--overwrite", "--quiet"])
    assert again.exit_code == 0, again.output  # the event files are tformer's own: --overwrite may replace them


def test_without_the_package_train_tensorboard_is_a_one_line_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pip install 'tformer\[tensorboard\]'"):
        check_available()
