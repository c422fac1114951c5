"""Nothing lost: --overwrite, the data cache, signals, a full disk, a killed start, resumed overrides, metrics."""

import json
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import tformer_cli.run_setup as run_setup
import tformer_cli.train as training
from conftest import write_config
from tformer_cli.cli import app
from tformer_cli.encoding import cache_dir
from tformer_cli.evaluation import label_smoothed_loss
from tformer_cli.files import append_jsonl, read_jsonl
from tformer_cli.optim import learning_rate
from tformer_cli.run_folder import MARKER, step_checkpoints

runner = CliRunner()


def _train(*args):
    return runner.invoke(app, ["train", *map(str, args), "--quiet"])


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_overwrite_never_deletes_a_folder_that_tformer_did_not_make(tmp_path):
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 1})
    user = tmp_path / "p"  # the example: a project folder that happens to hold a config.yaml
    (user / "src").mkdir(parents=True)
    (user / "config.yaml").write_text("x\n")
    (user / "src" / "a.py").write_text("y\n")
    result = _train(config, "--output-dir", user, "--overwrite")
    assert result.exit_code == 1 and "holds no tformer run (no .tformer-run marker)" in result.stderr
    assert (user / "src" / "a.py").read_text() == "y\n" and (user / "config.yaml").read_text() == "x\n"

    run = tmp_path / "run"
    assert _train(config, "--output-dir", run).exit_code == 0 and (run / MARKER).is_file()
    (run / "notes.txt").write_text("mine")  # a user's file inside a run folder is not tformer's to delete
    (run / "checkpoints" / "keep").mkdir()
    result = _train(config, "--output-dir", run, "--overwrite")
    assert result.exit_code == 1 and "holds files tformer did not write (2, e.g." in result.stderr
    assert (run / "notes.txt").read_text() == "mine" and step_checkpoints(run)
    (run / "notes.txt").unlink()
    (run / "checkpoints" / "keep").rmdir()
    assert _train(config, "--output-dir", run, "--overwrite").exit_code == 0  # only tformer's files: replaced

    link = tmp_path / "link"  # runs kept on other storage through a link: the link and its folder stay
    link.symlink_to(run, target_is_directory=True)
    before = (run / "model.safetensors").stat().st_mtime_ns
    result = _train(config, "--output-dir", link, "--overwrite")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and (run / "model.safetensors").stat().st_mtime_ns != before and step_checkpoints(run)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    result = _train(config, "--output-dir", tmp_path / "dangling")
    assert result.exit_code == 1 and result.stderr.strip().endswith(
        f"a link to {tmp_path / 'nowhere'}, which does not exist; create that folder or pick another --output-dir")


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("mine\n")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "not-a-folder"))
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 2})
    result = runner.invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"warning: the cache in {tmp_path / 'not-a-folder'} cannot be written (Not a "
                                          "directory): the next run learns and tokenises again; set TFORMER_CACHE "
                                          "to a writable folder"]
    assert step_checkpoints(tmp_path / "run") and (tmp_path / "not-a-folder").read_text() == "mine\n"


def test_a_full_cache_disk_is_one_warning_and_leaves_no_vocabulary_folder_without_its_files(tmp_path, monkeypatch):
    import tformer_cli.encoding as encoding
    from safetensors import SafetensorError

    cache = tmp_path / "cache"
    monkeypatch.setenv("TFORMER_CACHE", str(cache))
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 2})
    write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        if cache in path.parents:
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    def full_disk_as_safetensors_says(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(Path, "write_text", full_disk)
    monkeypatch.setattr(encoding, "save_file", full_disk_as_safetensors_says)
    result = _train(config, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"warning: the cache in {cache} cannot be written (No space left on device): "
                                          "the next run learns and tokenises again; set TFORMER_CACHE to a writable "
                                          "folder"]
    assert [p for p in cache.rglob("*") if p.is_file()] == [] and not any((cache / "tokenizers").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("TFORMER_CACHE", str(cache))
    for again in ("again", "once_more"):
        result = _train(config, "--output-dir", tmp_path / again)
        assert result.exit_code == 0 and result.stderr == "", result.output
        folder, = (cache / "tokenizers").iterdir()
        assert [p.name for p in folder.iterdir()] == ["tokenizer.json"]
        (folder / "tokenizer.json").unlink()  # as an earlier tformer's cut-short write left it: relearned, no warning


def test_a_dataset_folder_with_a_loading_script_never_runs_it(tmp_path):
    import shutil

    folder = tmp_path / "numbers"
    shutil.copytree("data/numbers", folder)  # train/validation/test.jsonl, and beside them a loading script of the folder's name
    (folder / "numbers.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    config = write_config(tmp_path / "t.yaml", data={"dataset": str(folder)}, train={"max_steps": 1})
    result = _train(config, "--output-dir", tmp_path / "run")
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "numbers.py" in result.stderr and not (tmp_path / "ran").exists()


class _Planted:
    """A pickle that would create a file if it were ever unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "pwned"))


@pytest.mark.parametrize("entry", ["pickle", "garbage", "truncated", "wrong tensors"])
def test_a_planted_or_broken_cache_entry_is_rebuilt_and_never_run(tmp_path, monkeypatch, entry):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 2})
    assert _train(config, "--output-dir", tmp_path / "first").exit_code == 0
    entries = sorted((cache_dir() / "encoded").iterdir())
    assert entries and all(p.suffix == ".safetensors" for p in entries)
    for path in entries:
        if entry == "pickle":
            path.write_bytes(pickle.dumps(_Planted(tmp_path / "pwned.txt")))
        elif entry == "garbage":
            path.write_bytes(os.urandom(300))
        elif entry == "truncated":
            path.write_bytes(path.read_bytes()[:-7])
        else:
            from safetensors.torch import save_file
            save_file({"src_ids": torch.zeros(3)}, str(path), metadata={"format": "3"})
    result = runner.invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "second")])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "pwned.txt").exists()
    notices = [line for line in result.stderr.splitlines() if "rebuilding the cached encoding" in line]
    assert len(notices) == len(entries)
    assert _same_weights(tmp_path / "first", tmp_path / "second")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_exits_128_plus_its_number_with_one_line_to_resume(tmp_path, monkeypatch, signum):
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 6})

    def signal_in_step_3(step, *args):  # after its forward and backward, before the optimizer's step
        if step == 3:
            os.kill(os.getpid(), signum)
        return learning_rate(step, *args)

    monkeypatch.setattr(training, "learning_rate", signal_in_step_3)
    run = tmp_path / "run"
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 128 + signum
    name = signal.Signals(signum).name
    assert result.stderr.strip() == (f"stopped by {name}; checkpoint {run}/checkpoints/step-00000003; "
                                     f"resume with: tformer train --resume {run}")
    monkeypatch.undo()
    assert _train("--resume", run).exit_code == 0
    assert _train(config, "--output-dir", tmp_path / "straight").exit_code == 0
    assert _same_weights(run, tmp_path / "straight")


def test_a_start_stopped_during_setup_is_accepted_by_the_command_it_suggests(tmp_path, monkeypatch):
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 3})
    run = tmp_path / "run"

    def stop(*args):  # SIGTERM once the data is loaded and the run's files saved, as the model is built
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_setup, "build_model", stop)
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 143
    assert result.stderr.strip() == ("stopped by SIGTERM before the first checkpoint; start it again "
                                     f"with: tformer train --resume {run}")
    monkeypatch.undo()
    evaluated = runner.invoke(app, ["eval", str(run)])
    assert evaluated.exit_code == 1 and f"tformer train --resume {run}" in evaluated.stderr
    again = _train(config, "--output-dir", run)  # the same command again is accepted too: nothing trained yet
    assert again.exit_code == 0, again.output
    (run / "model.safetensors").rename(tmp_path / "straight.safetensors")
    for checkpoint in step_checkpoints(run):  # back to the state the kill left
        import shutil
        shutil.rmtree(checkpoint)
    (run / "metrics.jsonl").unlink()
    assert _train("--resume", run).exit_code == 0
    assert torch.equal(torch.cat([t.flatten() for t in _weights(run).values()]),
                       torch.cat([t.flatten() for t in load_file(str(tmp_path / "straight.safetensors")).values()]))


def test_overrides_that_make_a_resume_diverge_are_not_recorded(tmp_path, monkeypatch):
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 2, "save_every": 2, "log_every": 1})
    run = tmp_path / "run"
    assert _train(config, "--output-dir", run).exit_code == 0

    def poisoned(*args):
        loss, nll = label_smoothed_loss(*args)
        return loss * float("nan"), nll

    monkeypatch.setattr(run_setup, "label_smoothed_loss", poisoned)
    result = _train("--resume", run, "--set", "train.max_steps=6", "--set", "train.lr=10")
    assert result.exit_code == 1 and "training diverged at step 3" in result.stderr
    saved = (run / "config.yaml").read_text()
    assert "max_steps: 2" in saved and "lr: 10" not in saved
    monkeypatch.undo()
    resumed = runner.invoke(app, ["train", "--resume", str(run), "--set", "train.max_steps=4", "--json"])
    assert json.loads(resumed.stdout)["step"] == 4
    assert "max_steps: 4" in (run / "config.yaml").read_text()  # recorded with the checkpoint made under it


def test_a_full_disk_is_one_line_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    import tformer_cli.runtime as runtime
    from safetensors import SafetensorError

    config = write_config(tmp_path / "t.yaml", train={"max_steps": 4, "save_every": 2})
    run = tmp_path / "run"
    real = runtime.save_model
    calls = []

    def fills_the_disk(model, filename, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                  "message: \"No space left on device\" })")
        real(model, filename, *args, **kwargs)

    monkeypatch.setattr(runtime, "save_model", fills_the_disk)
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "No space left on device" in result.stderr and f"resume with tformer train --resume {run}" in result.stderr
    assert [c.name for c in step_checkpoints(run)] == ["step-00000002"]
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]


def test_two_commands_writing_one_file_at_once_each_rename_a_whole_file_of_their_own(tmp_path):
    """A second writer of the same file, starting and finishing while the first is halfway through,
    neither fails the first nor makes it rename a half-written file into place: the later rename wins,
    with its whole text, and no temporary file is left."""
    import subprocess
    import sys

    from tformer_cli.files import replacing

    out = tmp_path / "hyps.txt"
    first, second = "first\n" * 50_000, "second\n" * 50_000
    with replacing(out) as tmp:
        with open(tmp, "w") as f:
            f.write(first[:1000])  # halfway through, the other command writes the file whole
            other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                    "from tformer_cli.files import write_text_atomic; "
                                    "write_text_atomic(Path(sys.argv[1]), sys.stdin.read())", str(out)],
                                   input=second, capture_output=True, text=True)
            assert other.returncode == 0, other.stderr
            assert out.read_text() == second
            f.write(first[1000:])
    assert out.read_text() == first
    assert [p.name for p in tmp_path.iterdir()] == ["hyps.txt"]


def test_a_write_removes_what_killed_writes_of_its_file_left_and_nothing_else(tmp_path):
    """Temporaries that this machine's killed processes left (and an earlier tformer's .NAME.tmp) go with
    the next write of their file, and another machine's once unchanged for a day; a running process's,
    another machine's written to lately and another file's stay."""
    import subprocess
    import sys
    import time

    from tformer_cli.files import ABANDONED_AFTER, _host, write_text_atomic

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(ended.stdout), os.getppid()
    host = _host()
    left = [f".out.txt.{host}.{dead}.tmp", ".out.txt.tmp", f".out.txt.restarted-elsewhere.{alive}.tmp"]
    kept = [f".out.txt.{host}.{alive}.tmp", f".out.txt.other-machine.{dead}.tmp", f".other.txt.{host}.{dead}.tmp",
            f".out.txt.5.{host}.{dead}.tmp"]  # the last: a temporary of out.txt.5
    for name in left + kept:
        (tmp_path / name).write_text("half")
    day_old = time.time() - ABANDONED_AFTER - 60
    os.utime(tmp_path / f".out.txt.restarted-elsewhere.{alive}.tmp", (day_old, day_old))
    (tmp_path / f".out.txt.{host}.{dead}.tmp.d").mkdir()  # not a temporary name at all
    write_text_atomic(tmp_path / "out.txt", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["out.txt", f".out.txt.{host}.{dead}.tmp.d"])


def test_temporaries_of_interrupted_writes_count_as_a_runs_own_files(tmp_path, trained_run):
    import shutil

    from tformer_cli.run_folder import foreign_files

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    own = [run / ".model.safetensors.tmp", run / ".model.safetensors.node-7.123.tmp",
           step_checkpoints(run)[0] / ".trainer.pt.node-7.123.tmp"]
    for path in own:
        path.write_bytes(b"half")
    (run / "checkpoints" / ".step-00000009.node-7.123.tmp").mkdir()
    (run / ".notes.txt.node-7.123.tmp").write_text("a user's")
    assert foreign_files(run) == [run / ".notes.txt.node-7.123.tmp"]


def test_a_disk_full_at_an_epochs_bpe_dropout_segmentation_is_one_line_and_the_run_resumes(tmp_path, monkeypatch):
    """The segmentation a checkpoint keeps is written inside the checkpoint's folder: a full disk there
    leaves the checkpoint before it (with its own segmentation) intact, and the run resumes from it."""
    import tformer_cli.encoding as encoding
    from safetensors import SafetensorError

    config = write_config(tmp_path / "t.yaml", train={"max_steps": 14, "save_every": 2, "keep_last": 20},
                          data={"bpe_dropout": 0.3, "max_samples": 120})
    run = tmp_path / "run"
    real, written = encoding.save_file, []

    def fills_the_disk(tensors, filename, metadata=None):  # at the run's second segmentation, not the cache's
        if str(run) in str(filename):
            written.append(filename)
            if len(written) > 1:
                raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                      "message: \"No space left on device\" })")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(encoding, "save_file", fills_the_disk)
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "No space left on device" in result.stderr and f"resume with tformer train --resume {run}" in result.stderr
    assert f"could not write {run / 'checkpoints' / 'step-'}" in result.stderr  # the checkpoint it was part of
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
    last = step_checkpoints(run)[-1]
    assert (last / "segmentation.safetensors").is_file()
    monkeypatch.undo()
    resumed = runner.invoke(app, ["train", "--resume", str(run), "--json", "--quiet"])
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["step"] == 14


@pytest.mark.parametrize("fails", ["every write", "the checkpoint after the best weights"])
def test_a_run_that_cannot_write_its_first_checkpoint_says_what_to_fix_and_the_command_that_starts_it_again(
        tmp_path, monkeypatch, fails):
    """Whether or not the best weights were written before it: the run folder holds a run, so typing the
    first command again would be refused; the one the error gives starts the run again."""
    import tformer_cli.runtime as runtime

    def read_only(model, filename, *args, **kwargs):
        if fails == "every write" or "checkpoints" in str(filename):
            raise OSError(30, "Read-only file system")
        real(model, filename, *args, **kwargs)

    real, run = runtime.save_model, tmp_path / "run"
    monkeypatch.setattr(runtime, "save_model", read_only)
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 2, "eval_every": 1, "save_every": 1})
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert (run / "model.safetensors").is_file() == (fails != "every write")
    again = f"tformer train --resume {run}"
    assert ("Read-only file system); nothing was replaced; no checkpoint was written yet: make the folder writable, "
            f"then start it again with {again}") in " ".join(result.stderr.split())
    monkeypatch.undo()
    resumed = _train(*again.split()[2:], "--json")
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["step"] == 2, resumed.output


def test_a_disk_full_when_figures_are_logged_is_one_line_naming_the_checkpoint_to_resume_from(tmp_path, monkeypatch):
    config = write_config(tmp_path / "t.yaml", train={"max_steps": 6, "save_every": 2, "log_every": 1})
    run = tmp_path / "run"
    real = run_setup.append_jsonl

    def fills_the_disk(path, record):
        if record["step"] > 3:
            raise OSError(28, "No space left on device")  # as a buffered write's close raises it: no file name
        real(path, record)

    monkeypatch.setattr(run_setup, "append_jsonl", fills_the_disk)
    result = _train(config, "--output-dir", run)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert f"could not write {run / 'metrics.jsonl'}" in result.stderr
    assert ("the records before are intact; the last checkpoint, step-00000002, is intact: free space on the disk, "
            f"then resume with tformer train --resume {run}") in " ".join(result.stderr.split())
    assert "another folder" not in result.stderr  # a run continues where it is
    monkeypatch.undo()
    assert _train("--resume", run).exit_code == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_a_disk_too_full_for_the_runs_marker_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        if ".tformer-run" in path.name:
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    result = _train(write_config(tmp_path / "t.yaml"), "--output-dir", tmp_path / "run")
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "No space left on device" in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("cause, remedy", [
    (OSError(28, "No space left on device"), "free space on the disk or pick another folder"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), "free space on the disk or pick "
                                                                                  "another folder"),
    (OSError(30, "Read-only file system"), "make the folder writable or pick another folder"),
    (IsADirectoryError(21, "Is a directory"), "that is a folder; name a file"),
    (FileNotFoundError(2, "No such file or directory"), "its folder was moved or deleted while the command ran; "
                                                        "leave it in place or pick another folder"),
    ("safetensors", "make the folder writable or pick another folder")])
def test_a_failed_write_says_what_to_do_about_its_cause(tmp_path, cause, remedy):
    from safetensors import SafetensorError

    from tformer_cli.files import write_failed

    if cause == "safetensors":  # safetensors' error carries no errno, only its text
        cause = SafetensorError('Error while serializing: I/O error: Read-only file system (os error 30) at path "x"')
    path = tmp_path / "model.safetensors"
    error = write_failed(path, cause, "nothing was replaced")
    assert str(error).startswith(f"could not write {path} (")
    assert str(error).endswith(f"; nothing was replaced: {remedy}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_new_files_is_not_said_to_have_moved(tmp_path, trained_run):
    """/proc is there, yet creating a file in it fails as if it were not (ENOENT)."""
    from tformer_cli.errors import CheckpointError
    from tformer_cli.files import write_text_atomic

    with pytest.raises(CheckpointError) as failed:
        write_text_atomic(Path("/proc/hyps.txt"), "text")
    assert str(failed.value).endswith("nothing was replaced: its folder takes no new files (a system folder); pick "
                                      "another folder")
    # a folder to make there, for an average or for eval's --output: the OS's error, said the same way
    for command in (["average", str(trained_run), "--last", "1", "--output", "/proc/tformer/average"],
                    ["eval", str(trained_run), "--max-samples", "1", "--output", "/proc/tformer/hyps.txt"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1 and result.output == ("error: /proc/tformer: its folder takes no new files (a "
                                                           "system folder); pick another path\n"), result.output


def test_metrics_are_strict_json_and_a_cut_last_line_is_skipped(tmp_path, trained_run):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1, "loss": float("nan"), "ppl": float("inf")})
    record = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"bare {name}"))
    assert record == {"step": 1, "loss": None, "ppl": None}
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # a kill in the middle of a write
    assert read_jsonl(path) == [record]
    append_jsonl(path, {"step": 3})  # the cut line is dropped, the next record starts a line of its own
    assert [r["step"] for r in read_jsonl(path)] == [1, 3]

    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"split": "validation", "step": 3')
    assert runner.invoke(app, ["plot", str(run)]).exit_code == 0
    assert runner.invoke(app, ["average", str(run), "--best", "1"]).exit_code == 0


def test_what_tformer_writes_is_as_readable_as_any_new_file(tmp_path, trained_run):
    # safetensors 0.8 creates its files readable by their owner alone (safetensors#782)
    (tmp_path / "plain").write_text("")
    expected = (tmp_path / "plain").stat().st_mode & 0o777
    for command in (["average", trained_run, "--last", "2", "--output", tmp_path / "avg"],
                    ["export", trained_run, tmp_path / "hf"]):
        assert runner.invoke(app, list(map(str, command))).exit_code == 0
    written = [p for folder in (trained_run, tmp_path / "avg", tmp_path / "hf") for p in folder.rglob("*")
               if p.is_file() and p.name != MARKER]
    assert {p.name for p in written} >= {"model.safetensors", "trainer.pt", "config.yaml", "config.json"}
    assert {str(p.relative_to(tmp_path.parent)): oct(p.stat().st_mode & 0o777) for p in written
            if p.stat().st_mode & 0o777 != expected} == {}


def test_an_export_cut_short_leaves_no_folder_behind(tmp_path, trained_run, monkeypatch):
    import safetensors.torch

    def fills_the_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    result = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "hf")])
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert runner.invoke(app, ["export", str(trained_run), str(tmp_path / "hf")]).exit_code == 0  # nothing in its way


def test_an_image_or_an_average_cut_short_by_a_full_disk_is_one_line_and_keeps_what_was_there(
        tmp_path, trained_run, monkeypatch):
    import matplotlib.figure
    import safetensors.torch

    def fills_the_disk(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")  # as PIL raises it: no file name, so no OSError handler

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fills_the_disk)
    earlier = tmp_path / "curves.png"
    earlier.write_bytes(b"an earlier plot")
    for command in (["plot", trained_run, "--output", earlier],
                    ["inspect-attention", trained_run, "one", "--save", earlier]):
        result = runner.invoke(app, list(map(str, command)))
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "No space left on device" in result.stderr and "free space on the disk" in result.stderr
        assert earlier.read_bytes() == b"an earlier plot" and sorted(tmp_path.iterdir()) == [earlier]

    def weights_fill_it(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", weights_fill_it)
    result = runner.invoke(app, ["average", str(trained_run), "--last", "2", "--output", str(tmp_path / "avg")])
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    assert sorted(tmp_path.iterdir()) == [earlier]  # no empty average folder left to trip the next try
    monkeypatch.undo()
    assert runner.invoke(app, ["plot", str(trained_run), "--output", str(earlier)]).exit_code == 0
    assert earlier.read_bytes().startswith(b"\x89PNG")
    (tmp_path / "folder.png").mkdir()
    result = runner.invoke(app, ["plot", str(trained_run), "--output", str(tmp_path / "folder.png")])
    assert result.exit_code == 1 and result.stderr.strip().endswith("nothing was replaced: that is a folder; name a file")


def test_a_link_named_as_an_output_stays_a_link_and_what_it_points_to_is_written(tmp_path, trained_run):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hf").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "hyps.txt").symlink_to(tmp_path / "elsewhere.txt")  # not there yet
    for command in (["export", trained_run, tmp_path / "hf"],
                    ["eval", trained_run, "--split", "test", "--max-samples", "3", "--output", tmp_path / "hyps.txt"]):
        assert runner.invoke(app, list(map(str, command))).exit_code == 0
    assert (tmp_path / "hf").is_symlink() and (tmp_path / "elsewhere" / "model.safetensors").is_file()
    assert (tmp_path / "hyps.txt").is_symlink() and len((tmp_path / "elsewhere.txt").read_text().splitlines()) == 3


def test_resume_refuses_a_folder_that_tformer_train_did_not_start(tmp_path, trained_run):
    average = tmp_path / "average"  # a standalone average: a config, a tokenizer and weights, no run
    assert runner.invoke(app, ["average", str(trained_run), "--last", "2", "--output", str(average)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in average.iterdir()}
    result = _train("--resume", average)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "not a run that tformer train started" in result.stderr and "--output-dir NEW_FOLDER" in result.stderr
    assert {p.name: p.read_bytes() for p in average.iterdir()} == before


def test_an_average_inside_a_run_goes_where_overwrite_knows_it(tmp_path, trained_run):
    import shutil

    from tformer_cli.run_folder import foreign_files

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for elsewhere in (run / "mine", run / "checkpoints", run / "checkpoints" / "best2"):
        result = runner.invoke(app, ["average", str(run), "--last", "2", "--output", str(elsewhere)])
        assert result.exit_code == 1 and f"an average goes to {run / 'checkpoints'}/average-NAME" in result.stderr
    assert foreign_files(run) == []
    named = runner.invoke(app, ["average", str(run), "--last", "2", "--output", str(run / "checkpoints" / "average-mine")])
    assert named.exit_code == 0, named.output
    assert foreign_files(run) == []  # so --overwrite may replace the run, the average with it
