"""Checkpoints written beside training (a GPU's way, forced here on the CPU) against written at once."""

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tformer_cli.run_setup as run_setup
import tformer_cli.train as training
from conftest import write_config
from tformer_cli.config import load_config
from tformer_cli.run_folder import step_checkpoints
from tformer_cli.runtime import load_trainer_state
from tformer_cli.train import train


def _files(run):
    """Every weights file and trainer state the run wrote, by path inside it."""
    weights = {p.relative_to(run): load_file(str(p)) for p in sorted(run.rglob("model.safetensors"))}
    states = {c.relative_to(run): load_trainer_state(c) for c in step_checkpoints(run)}
    return weights, states


def _assert_equal_trees(ours, theirs, where=""):
    assert type(ours) is type(theirs), where
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            _assert_equal_trees(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_equal_trees(a, b, f"{where}/{i}")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif where.endswith(("elapsed", "seconds")):  # clocks
        return
    else:
        assert ours == theirs, where


def test_checkpoints_written_beside_training_hold_their_step_as_those_written_at_once(tmp_path, monkeypatch):
    """Each checkpoint, the best weights and the EMA's are those of the step they belong to, though the
    writes are slowed so that training runs several steps ahead of them; tied matrices stored once."""
    config = load_config(write_config(tmp_path / "t.yaml", train={
        "max_steps": 8, "save_every": 2, "eval_every": 4, "keep_last": 2, "ema_decay": 0.9}))
    train(config, tmp_path / "at-once")

    real, spans, steps_logged = training.save_checkpoint, [], []

    def slow(run_dir, step, *args, **kwargs):  # on the writer's thread
        assert threading.current_thread() is not threading.main_thread()
        start = time.perf_counter()
        time.sleep(0.4)
        path = real(run_dir, step, *args, **kwargs)
        spans.append((step, start, time.perf_counter()))
        return path

    announced = []

    def callback(event, data):
        if event == "step":
            steps_logged.append((data["step"], time.perf_counter()))
        elif event == "checkpoint":  # sent once the checkpoint is on disk
            announced.append((data["step"], (Path(data["path"]) / "model.safetensors").exists()))

    from tformer_cli.run_writer import RunWriter

    weights, copies = RunWriter.weights, []

    def counted(writer, model):
        copies.append(model)
        return weights(writer, model)

    monkeypatch.setattr(RunWriter, "weights", counted)
    monkeypatch.setattr(run_setup, "writes_in_background", lambda device: True)
    monkeypatch.setattr(training, "save_checkpoint", slow)
    train(config, tmp_path / "beside", callback=callback)
    assert announced == [(2, True), (4, True), (6, True), (8, True)]
    # a copy of the weights a checkpoint and one of the average's: the best weights (validation at steps
    # 4 and 8) share their step's checkpoint's copy
    assert len(copies) == 4 + 4

    ours, theirs = _files(tmp_path / "beside"), _files(tmp_path / "at-once")
    assert sorted(map(str, ours[0])) == ["checkpoints/ema/model.safetensors", "checkpoints/step-00000006/model.safetensors",
                                         "checkpoints/step-00000008/model.safetensors", "model.safetensors"]
    _assert_equal_trees(ours, theirs)
    # training went on while step 2's checkpoint was written: steps 3 and 4 were logged before it ended
    step, _, ended = spans[0]
    assert step == 2 and [s for s, at in steps_logged if at < ended][-1] >= 4


def test_the_best_weights_copy_is_not_held_past_its_step(tmp_path, monkeypatch):
    """Written beside training, validation copies the best weights to the host and the checkpoint of
    its step writes from that copy; where no checkpoint follows (save_every 4, eval_every 2) the copy
    is dropped at the step's end, not held (a model's worth of host memory) until the next checkpoint."""
    config = load_config(write_config(tmp_path / "t.yaml", train={
        "max_steps": 6, "save_every": 4, "eval_every": 2, "eval_bleu": False}))
    held, evaluate = [], training._evaluate

    def recorded(setup, state, notify):
        held.append((state.step, setup.best_copy))  # what an earlier step left
        return evaluate(setup, state, notify)

    monkeypatch.setattr(run_setup, "writes_in_background", lambda device: True)
    monkeypatch.setattr(training, "_evaluate", recorded)
    train(config, tmp_path / "run")
    assert held == [(2, None), (4, None), (6, None)]


@pytest.mark.parametrize("background", [False, True, "fast"])
def test_a_checkpoint_that_fails_to_write_stops_the_run_with_one_line_naming_the_last_intact(tmp_path, monkeypatch,
                                                                                             background):
    """Written beside training, the failure of step 4's write is found when step 6 hands over its own
    (or when training ends): the same line, and step 2's checkpoint kept. "fast": the writer's thread
    finishes each job before the next hand-over, so the failure is found at the step's own next one."""
    from typer.testing import CliRunner

    import tformer_cli.runtime as runtime
    from tformer_cli.cli import app
    from tformer_cli.run_writer import RunWriter

    if background == "fast":
        submit = RunWriter.submit

        def after_the_jobs_before(writer, job):
            writer.wait()
            submit(writer, job)

        monkeypatch.setattr(RunWriter, "submit", after_the_jobs_before)

    real, calls = runtime.save_model, []

    def fills_the_disk(model, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real(model, filename, *args, **kwargs)

    monkeypatch.setattr(runtime, "save_model", fills_the_disk)
    monkeypatch.setattr(run_setup, "writes_in_background", lambda device: bool(background))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(write_config(tmp_path / "t.yaml", train={"max_steps": 6,
                                                                                            "save_every": 2})),
                                      "--output-dir", str(run), "--quiet"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "No space left on device" in result.stderr and f"resume with tformer train --resume {run}" in result.stderr
    assert "step-00000002, is intact" in " ".join(result.stderr.split())
    assert [c.name for c in step_checkpoints(run)] == ["step-00000002"]
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]


def test_the_writer_runs_jobs_in_order_and_a_failed_write_does_not_hide_what_stopped_training():
    """Leaving training by an error (Ctrl-C here), every job handed over has run, in order, and the
    error that stopped training is the one raised, not the write that failed meanwhile."""
    from tformer_cli.run_writer import RunWriter

    writer, ran = RunWriter(background=True), []

    def job(name, fails=False):
        def run():
            time.sleep(0.05)
            ran.append((name, threading.current_thread() is threading.main_thread()))
            if fails:
                raise OSError(28, "No space left on device")
        return run

    with pytest.raises(KeyboardInterrupt):
        with writer.finishing():
            for name in ("step 2", "best"):
                writer.submit(job(name))
            writer.submit(job("step 4", fails=True))
            writer.submit(job("step 6"))
            raise KeyboardInterrupt
    assert ran == [("step 2", False), ("best", False), ("step 4", False), ("step 6", False)]
    # left normally, the failure is raised
    writer = RunWriter(background=True)
    with pytest.raises(OSError, match="No space left"):
        with writer.finishing():
            writer.submit(job("step 8", fails=True))
