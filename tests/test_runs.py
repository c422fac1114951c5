from pathlib import Path

import pytest

from conftest import write_config
from tformer_cli.config import load_config
from tformer_cli.errors import UsageError
from tformer_cli.run_folder import step_checkpoints
from tformer_cli.runs import prepare_run
from tformer_cli.train import train


def test_a_device_that_is_not_here_is_named_where_it_was_asked_for(tmp_path, monkeypatch):
    """A config's (or a resumed GPU run's) train.device, or the --device flag."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = write_config(tmp_path / "d.yaml", train={"device": "cuda"})
    with pytest.raises(UsageError, match=r"^train.device cuda: no CUDA device is available; use --device cpu or auto$"):
        prepare_run(path, None, [], tmp_path / "run")
    with pytest.raises(UsageError, match=r"^--device cuda: no CUDA device is available"):
        prepare_run(write_config(tmp_path / "c.yaml"), None, [], tmp_path / "run", device="cuda")
    assert not (tmp_path / "run").exists()


def test_a_new_run_never_overwrites_an_old_one(tmp_path):
    path = write_config(tmp_path / "o.yaml", train={"max_steps": 1})
    train(load_config(path), tmp_path / "run")
    with pytest.raises(UsageError, match="already holds a run; continue it with --resume"):
        prepare_run(path, None, [], tmp_path / "run")
    with pytest.raises(UsageError, match="either a CONFIG"):
        prepare_run(None, None, [], None)
    with pytest.raises(UsageError, match="--device gpu: expected auto, cpu or cuda"):  # checked before clearing
        prepare_run(path, None, [], tmp_path / "run", overwrite=True, device="gpu")
    assert step_checkpoints(tmp_path / "run")
    config, run_dir = prepare_run(path, None, [], tmp_path / "run", overwrite=True)
    assert run_dir.is_dir() and not any(run_dir.iterdir())  # emptied: the folder may be a link or a mount point
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="is not empty and holds no tformer run"):
        prepare_run(path, None, [], other, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"


def test_a_run_being_trained_is_neither_trained_again_nor_overwritten_and_a_failed_start_leaves_no_folder(tmp_path):
    from tformer_cli.errors import DataError
    from tformer_cli.run_folder import holding

    path = write_config(tmp_path / "w.yaml", train={"max_steps": 1})
    run = tmp_path / "run"
    train(load_config(path), run)
    before = sorted(p.name for p in run.rglob("*"))
    with holding(run):  # as a training process holds it
        busy = "another `tformer train` is writing this run now"
        with pytest.raises(UsageError, match=busy):
            train(*prepare_run(None, run, ["train.max_steps=2"], None), resume=True)
        with pytest.raises(UsageError, match=busy):
            prepare_run(path, None, [], run, overwrite=True)
    assert sorted(p.name for p in run.rglob("*")) == before
    assert train(*prepare_run(None, run, ["train.max_steps=2"], None), resume=True).state.step == 2  # released
    with pytest.raises(DataError):
        train(load_config(path, ["data.dataset=./nowhere"]), tmp_path / "failed")
    assert not (tmp_path / "failed").exists()


def test_a_killed_trainings_hold_on_its_run_goes_with_it(tmp_path):
    import signal
    import subprocess
    import sys

    from tformer_cli.run_folder import check_not_held

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from tformer_cli.run_folder import holding\n"
                               "with holding(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
                               str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match="another `tformer train` is writing this run now"):
            check_not_held(run)
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of its own: the OS lets the lock go
        holder.wait()
    check_not_held(run)


def test_a_runs_config_finds_its_local_data_from_any_directory(tmp_path, monkeypatch):
    files = {"train": "data/numbers/train.jsonl", "validation": "data/numbers/validation.jsonl",
             "test": ["data/numbers/test.jsonl", "nope.jsonl"]}  # the test split is not read in training
    path = write_config(tmp_path / "rel.yaml", data={"data_files": files})
    config, _ = prepare_run(path, None, [], tmp_path / "run")
    here = Path.cwd()
    assert config.data.dataset == str(here / "data/numbers")
    assert config.data.data_files == {"train": str(here / "data/numbers/train.jsonl"),
                                      "validation": str(here / "data/numbers/validation.jsonl"),
                                      "test": [str(here / "data/numbers/test.jsonl"), "nope.jsonl"]}
    config, _ = prepare_run(path, None, ["data.dataset=bentrevett/multi30k"], tmp_path / "run")
    assert config.data.dataset == "bentrevett/multi30k"  # a hub id is not a path here
    # a run saved with a relative path (before paths were made absolute), resumed where it is missing
    train(load_config(write_config(tmp_path / "tiny.yaml", train={"max_steps": 1})), tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    config, _ = prepare_run(None, tmp_path / "run", [], None)
    assert config.data.dataset == "data/numbers"  # kept as written
