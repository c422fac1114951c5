import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import write_config
from tformer_cli.cli import app
from tformer_cli.runtime import step_checkpoints


def _torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "-m", "tformer_cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_two_processes_train_as_one_process_accumulating_two_batches(tmp_path):
    # no dropout, and 4 steps within the first epoch (whose last odd batch two processes leave out)
    config = write_config(tmp_path / "p.yaml", model={"dropout": 0.0}, data={"max_samples": 800},
                          train={"max_steps": 4, "eval_every": 2, "save_every": 2, "log_every": 2})
    one, two = tmp_path / "one", tmp_path / "two"
    single = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(one), "--quiet",
                                      "--set", "train.grad_accum=2"])
    assert single.exit_code == 0, single.output
    both = _torchrun(2, "train", str(config), "--output-dir", str(two), "--quiet", "--json")
    assert both.returncode == 0, both.stderr[-3000:]
    summary = json.loads(both.stdout)  # rank 0 alone prints
    assert summary["step"] == 4 and summary["stop_reason"] == "reached train.max_steps 4"
    # every step the same gradients, so the same weights, losses and validation
    assert [c.name for c in step_checkpoints(two)] == [c.name for c in step_checkpoints(one)]
    for a, b in zip(step_checkpoints(one), step_checkpoints(two)):
        ours, theirs = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        for name in ours:
            torch.testing.assert_close(theirs[name], ours[name], rtol=1e-5, atol=1e-6)
    records = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (one, two)]
    assert [r["split"] for r in records[0]] == [r["split"] for r in records[1]]
    for a, b in zip(*records):
        assert a["step"] == b["step"] and a.get("epoch") == b.get("epoch") in (0, None)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # two processes' first 2 steps, resumed by one process taking two batches a step: the same run
    halfway = tmp_path / "halfway"
    assert _torchrun(2, "train", str(config), "--output-dir", str(halfway), "--quiet",
                     "--set", "train.max_steps=2").returncode == 0
    alone = CliRunner().invoke(app, ["train", "--resume", str(halfway), "--quiet", "--set", "train.max_steps=4",
                                     "--set", "train.grad_accum=2"])
    assert alone.exit_code == 0, alone.output
    ours, theirs = (load_file(str(step_checkpoints(run)[-1] / "model.safetensors")) for run in (two, halfway))
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=1e-5, atol=1e-6)
    # resumed by two processes, the run goes on from its last checkpoint; a time limit stops both at
    # one step (rank 0's clock), or one would wait forever for the other's gradients
    limit = summary["elapsed"] + 2
    more = _torchrun(2, "train", "--resume", str(two), "--set", "train.max_steps=null", "--set",
                     f"train.max_time={limit}", "--quiet", "--json")
    assert more.returncode == 0, more.stderr[-3000:]
    resumed = json.loads(more.stdout)
    assert resumed["stop_reason"] == f"reached train.max_time {limit:g} s" and resumed["step"] > 4


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_two_processes_with_dropout_resume_bit_for_bit(tmp_path):
    config = write_config(tmp_path / "d.yaml", model={"dropout": 0.3}, data={"max_samples": 800},
                          train={"max_steps": 4, "save_every": 2, "eval_every": 1000})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _torchrun(2, "train", str(config), "--output-dir", str(straight), "--quiet").returncode == 0
    first = _torchrun(2, "train", str(config), "--output-dir", str(resumed), "--quiet", "--set", "train.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert _torchrun(2, "train", "--resume", str(resumed), "--set", "train.max_steps=4", "--quiet").returncode == 0
    ours, theirs = (load_file(str(step_checkpoints(run)[-1] / "model.safetensors")) for run in (straight, resumed))
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_a_mistake_stops_every_process_with_one_line_each(tmp_path):
    config = write_config(tmp_path / "bad.yaml", data={"dataset": str(tmp_path / "missing")})
    result = _torchrun(2, "train", str(config), "--output-dir", str(tmp_path / "run"), "--quiet")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and sorted(errors) == [
        f"error: data.dataset: no such folder '{tmp_path / 'missing'}'; check the path (relative paths start "
        "from the current directory)",
        "error: process 1: another training process stopped (RuntimeError); its own error says why"]
    assert "tformer_cli/" not in result.stderr  # no traceback from inside tformer (torchrun reports its own)


def _model() -> torch.nn.Sequential:
    """Buckets of 1 KiB: [last layer], [middle layer], [first layer], [unused layer]."""
    torch.manual_seed(0)  # the same weights in every process
    return torch.nn.Sequential(torch.nn.Linear(3, 3),  # not used: its gradient never finishes
                               torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _sum_in_two_processes(rank: int, store_file: str, results: str) -> None:
    import torch.distributed as dist

    from tformer_cli.parallel import GradientSync, Workers

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        model = _model()
        sync = GradientSync(Workers(rank, 2), model.parameters(), bucket_mb=1024 / 2**20)
        torch.manual_seed(1 + rank)  # a batch of its own
        model[1:](torch.randn(16, 8)).square().sum().backward()  # not armed: accumulates only
        sync.arm()
        model[1:](torch.randn(16, 8)).square().sum().backward()
        started_during_backward = sync.started
        sync.finish()
        sync.close()
        torch.save({"grads": [p.grad for p in model.parameters()], "started": started_during_backward,
                    "buckets": len(sync.buckets)}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_gradient_sync_sums_buckets_while_backward_runs(tmp_path):
    import torch.multiprocessing as mp

    results = str(tmp_path / "grads")
    mp.spawn(_sum_in_two_processes, args=(str(tmp_path / "store"), results), nprocs=2)
    ranks = [torch.load(f"{results}.{rank}") for rank in (0, 1)]
    model = _model()
    for rank in (0, 1):  # both processes' two batches, accumulated in one process
        torch.manual_seed(1 + rank)
        for _ in range(2):
            model[1:](torch.randn(16, 8)).square().sum().backward()
    expected = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for result in ranks:
        for got, want in zip(result["grads"], expected):
            torch.testing.assert_close(got, want)
        # the used layers' buckets started from the hooks, during backward; the unused one in finish
        assert (result["buckets"], result["started"]) == (4, 3)
