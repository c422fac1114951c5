"""Several training processes (gloo, on the CPU): DDP and FSDP2 take the steps one process takes with
grad_accum, checkpoints resume on another number of processes, and a process that dies stops the rest."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import parallel_config, write_config
from tformer_cli.cli import app
from tformer_cli.run_folder import step_checkpoints

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")


def _torchrun(processes: int, *args: str, monitor_interval: float = 0.1) -> subprocess.CompletedProcess:
    """tformer under torchrun, which looks at its processes every ``monitor_interval`` seconds (its own
    default: 0.1) and stops the others once one has failed; a process that crashes (SIGSEGV, SIGABRT)
    prints its Python stack, which the failed assertion shows (torchrun alone says only "Signal 11
    received")."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               f"--monitor-interval={monitor_interval}", "-m", "tformer_cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def _torchrun_ok(processes: int, *args: str) -> subprocess.CompletedProcess:
    """``_torchrun`` that must succeed; a failure shows the processes' stderr."""
    result = _torchrun(processes, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _one_process(*args: str) -> None:
    result = CliRunner().invoke(app, [*args, "--quiet"])
    assert result.exit_code == 0, result.output


def _assert_same_weights(run_a, run_b, checkpoint: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ours, theirs = (load_file(str(run / checkpoint / "model.safetensors")) for run in (run_a, run_b))
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=rtol, atol=atol)


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_losses(run_a, run_b, rel: float = 1e-5) -> None:
    a, b = _records(run_a), _records(run_b)
    assert [(r["split"], r["step"]) for r in a] == [(r["split"], r["step"]) for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=rel)


@pytest.fixture
def config(tmp_path):
    return parallel_config(tmp_path / "p.yaml")


def test_ddp_two_processes_train_as_one_process_accumulating_two_batches(tmp_path, config):
    one, two = tmp_path / "one", tmp_path / "two"
    alone = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(one), "--set", "train.grad_accum=2",
                                     "--json"])
    assert alone.exit_code == 0, alone.output
    both = _torchrun_ok(2, "train", str(config), "--output-dir", str(two), "--quiet", "--json")
    summary = json.loads(both.stdout)  # rank 0 alone prints
    assert summary["step"] == 4 and summary["stop_reason"] == "reached train.max_steps 4"
    assert (summary["processes"], summary["target_tokens"]) == (2, json.loads(alone.stdout)["target_tokens"])
    # every step the same gradients, so the same weights, losses and validation
    assert [c.name for c in step_checkpoints(two)] == [c.name for c in step_checkpoints(one)]
    for checkpoint in step_checkpoints(one):
        _assert_same_weights(one, two, f"checkpoints/{checkpoint.name}")
    _assert_same_losses(one, two)
    # validated together, each process translating every other sentence: the scores one process gets
    scores = [[(r["bleu"], r["chrf"], r["exact_match"]) for r in _records(run) if r["split"] == "validation"]
              for run in (one, two)]
    assert scores[0] == scores[1] and len(scores[0]) == 2


@pytest.mark.slow  # two launches of two processes, ~10 s
def test_ddp_runs_resume_on_another_number_of_processes_and_stop_together_at_a_time_limit(tmp_path, config):
    # two processes' first 2 steps, resumed by one process taking two batches a step: the run one
    # process takes (which two processes take: the test above)
    one, halfway = tmp_path / "one", tmp_path / "halfway"
    _one_process("train", str(config), "--output-dir", str(one), "--set", "train.grad_accum=2")
    _torchrun_ok(2, "train", str(config), "--output-dir", str(halfway), "--quiet", "--set", "train.max_steps=2")
    resumed = CliRunner().invoke(app, ["train", "--resume", str(halfway), "--set", "train.max_steps=4", "--set",
                                       "train.grad_accum=2", "--quiet", "--json"])
    assert resumed.exit_code == 0, resumed.output
    _assert_same_weights(one, halfway)
    # resumed by two processes, the run goes on from its last checkpoint; a time limit stops both at
    # one step (rank 0's clock), or one would wait forever for the other's gradients
    limit = json.loads(resumed.stdout)["elapsed"] + 2
    more = _torchrun_ok(2, "train", "--resume", str(halfway), "--set", "train.max_steps=null", "--set",
                        f"train.max_time={limit}", "--quiet", "--json")
    resumed = json.loads(more.stdout)
    assert resumed["stop_reason"] == f"reached train.max_time {limit:g} s" and resumed["step"] > 4


@pytest.mark.slow  # each process compiles, both on the 2 cores at once: ~50 s an engine
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_train_compiled_as_they_train_eager(tmp_path, config, engine):
    """train.compile (auto: a GPU's default) under torchrun, several processes as on eight GPUs: the
    engine's gradient hooks around each process's compiled encoder and decoder give the eager run's
    weights and losses (within compiled fp32's rounding)."""
    runs = {}
    for compiled in (False, True):
        runs[compiled] = tmp_path / f"compiled-{compiled}"
        trained = _torchrun_ok(2, "train", str(config), "--output-dir", str(runs[compiled]), "--quiet", "--json",
                               "--set", f"train.parallel={engine}", "--set", f"train.compile={str(compiled).lower()}")
        summary = json.loads(trained.stdout)
        assert (summary["processes"], summary["compiled"]) == (2, compiled)
    for checkpoint in step_checkpoints(runs[False]):
        _assert_same_weights(runs[False], runs[True], f"checkpoints/{checkpoint.name}", rtol=1e-4, atol=1e-5)
    _assert_same_losses(runs[False], runs[True], rel=1e-4)


@pytest.mark.slow
def test_with_step_tokens_one_config_trains_the_same_on_one_process_or_two(tmp_path):
    """train.step_tokens: the same config, unchanged, takes the same steps on one process (one batch a
    step) and on two (half of each step each), and a run of two resumes on one as if never stopped."""
    config = write_config(tmp_path / "s.yaml", model={"dropout": 0.0}, data={"max_samples": 800},
                          train={"step_tokens": 1200, "max_tokens": 1200, "max_steps": 4, "eval_every": 2,
                                 "save_every": 2, "log_every": 2})
    one, two, halfway = tmp_path / "one", tmp_path / "two", tmp_path / "halfway"
    _one_process("train", str(config), "--output-dir", str(one))
    _torchrun_ok(2, "train", str(config), "--output-dir", str(two), "--quiet")
    for checkpoint in step_checkpoints(one):
        _assert_same_weights(one, two, f"checkpoints/{checkpoint.name}")
    _assert_same_losses(one, two)
    _torchrun_ok(2, "train", str(config), "--output-dir", str(halfway), "--quiet", "--set", "train.max_steps=2")
    _one_process("train", "--resume", str(halfway), "--set", "train.max_steps=4")
    _assert_same_weights(one, halfway)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="NCCL needs a GPU"))])
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_group_of_one_trains_through_the_engines_as_one_process_does(tmp_path, config, monkeypatch, device,
                                                                        engine, compiled):
    """The whole loop under DDP or FSDP2 in a process group of one: gloo on the CPU, NCCL on a GPU (which
    refuses two ranks on one device), where the machine has a single one. The same weights and losses
    as without a group; checkpoints gathered to whole tensors. Also compiled (``train.compile``, a GPU's
    default): the engines' hooks around the compiled encoder and decoder."""
    import tformer_cli.parallel as parallel
    import tformer_cli.run_setup as run_setup
    from tformer_cli.config import load_config
    from tformer_cli.parallel import Workers, leave
    from tformer_cli.train import train

    overrides = [f"train.device={device}", f"train.parallel={engine}", f"train.compile={str(compiled).lower()}"]
    train(load_config(config, overrides), tmp_path / "alone")
    trainers = []  # what the loop trains through

    def distribute(*args):
        trainers.append(parallel.distribute(*args))
        return trainers[-1]

    monkeypatch.setattr(run_setup, "distribute", distribute)
    monkeypatch.setattr(parallel, "left_group", False)  # as it was, after ``leave``
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                         world_size=1, device_id=torch.device("cuda", 0) if device == "cuda" else None)
    try:
        train(load_config(config, overrides), tmp_path / "grouped", workers=Workers(grouped=True))
    finally:
        leave()
    assert type(trainers[0]).__name__ == {"ddp": "DistributedDataParallel", "fsdp": "FSDPSeq2SeqLoss"}[engine]
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if device == "cuda" else {}  # CUDA's atomic adds reorder sums
    for checkpoint in step_checkpoints(tmp_path / "alone"):
        _assert_same_weights(tmp_path / "alone", tmp_path / "grouped", f"checkpoints/{checkpoint.name}", **tolerance)
    _assert_same_losses(tmp_path / "alone", tmp_path / "grouped")


def test_under_fsdp_a_steps_validation_and_checkpoint_gather_the_weights_once(tmp_path, config, monkeypatch):
    """Gathering the shards is a collective over the whole model: a step that validates and saves
    gathers once for both, and the moving average's weights once more. What is saved is still the
    single process's (group of one, gloo)."""
    import tformer_cli.parallel as parallel
    import tformer_cli.run_setup as run_setup
    from tformer_cli.config import load_config
    from tformer_cli.parallel import Workers, leave
    from tformer_cli.train import train

    overrides = ["train.parallel=fsdp", "train.ema_decay=0.9"]  # validation and a checkpoint at steps 2 and 4
    train(load_config(config, overrides), tmp_path / "alone")
    gathers = []

    def gathered(tree):
        gathers.append(len(tree))
        return parallel.gathered(tree)

    monkeypatch.setattr(run_setup, "gathered", gathered)
    monkeypatch.setattr(parallel, "left_group", False)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        train(load_config(config, overrides), tmp_path / "sharded", workers=Workers(grouped=True))
    finally:
        leave()
    assert len(gathers) == 4  # steps 2 and 4: the weights, then their average
    for checkpoint in ("", *(f"checkpoints/{c.name}" for c in step_checkpoints(tmp_path / "alone")), "checkpoints/ema"):
        _assert_same_weights(tmp_path / "alone", tmp_path / "sharded", checkpoint)
    _assert_same_losses(tmp_path / "alone", tmp_path / "sharded")


def test_a_peer_lost_while_clipping_is_one_line(tmp_path, config, monkeypatch):
    """Under FSDP the gradient norm is a collective of its own: a peer that dies then is reported as in
    any other collective (a rare CI failure printed a 263-line traceback from here)."""
    import tformer_cli.parallel as parallel
    from tformer_cli.config import load_config
    from tformer_cli.errors import TformerError
    from tformer_cli.parallel import Workers, leave
    from tformer_cli.train import train

    def lost(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lost)
    monkeypatch.setattr(parallel, "left_group", False)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(TformerError, match="another training process stopped"):
            train(load_config(config, ["train.parallel=fsdp"]), tmp_path / "run", workers=Workers(grouped=True))
    finally:
        leave()


@pytest.mark.slow
def test_ddp_accumulates_without_syncing_until_the_last_batch(tmp_path, config):
    one, two = tmp_path / "one", tmp_path / "two"
    _one_process("train", str(config), "--output-dir", str(one), "--set", "train.grad_accum=4")
    _torchrun_ok(2, "train", str(config), "--output-dir", str(two), "--quiet", "--set", "train.grad_accum=2")
    _assert_same_weights(one, two)
    _assert_same_losses(one, two)


@pytest.mark.slow
def test_fsdp_shards_and_trains_as_one_process_and_resumes_on_any_number(tmp_path, config):
    """FSDP2 on CPU/gloo: the same weights, losses and moving average as one process; the run folder
    holds whole tensors, so one process or DDP continues a sharded run, and FSDP a single one."""
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    _one_process("train", str(config), "--output-dir", str(one), "--set", "train.grad_accum=2",
                 "--set", "train.ema_decay=0.9")
    _torchrun_ok(2, "train", str(config), "--output-dir", str(sharded), "--quiet", "--set", "train.parallel=fsdp",
                 "--set", "train.ema_decay=0.9")
    for checkpoint in ("", "checkpoints/step-00000002", "checkpoints/step-00000004", "checkpoints/ema"):
        _assert_same_weights(one, sharded, checkpoint)
    _assert_same_losses(one, sharded)
    saved = [torch.load(step_checkpoints(run)[-1] / "trainer.pt", weights_only=True) for run in (one, sharded)]
    torch.testing.assert_close(saved[1]["optimizer"], saved[0]["optimizer"], rtol=1e-5, atol=1e-7)
    # two more steps from step 2 of the sharded run: by one process, by DDP and by FSDP
    straight = tmp_path / "straight"
    _one_process("train", str(config), "--output-dir", str(straight), "--set", "train.grad_accum=2",
                 "--set", "train.max_steps=6")
    for name, how in (("alone", None), ("ddp", "ddp"), ("fsdp", "fsdp")):
        run = tmp_path / name
        _torchrun_ok(2, "train", str(config), "--output-dir", str(run), "--quiet", "--set", "train.max_steps=2",
                     "--set", "train.parallel=fsdp")
        more = ["--set", "train.max_steps=6"]
        if how is None:
            _one_process("train", "--resume", str(run), *more, "--set", "train.grad_accum=2")
        else:
            _torchrun_ok(2, "train", "--resume", str(run), "--quiet", *more, "--set", f"train.parallel={how}")
        _assert_same_weights(straight, run)


@pytest.mark.slow
def test_fsdp_trains_in_bf16(tmp_path, config):
    run = tmp_path / "bf16"
    _torchrun_ok(2, "train", str(config), "--output-dir", str(run), "--quiet", "--json",
                 "--set", "train.parallel=fsdp", "--set", "train.precision=bf16", "--set", "train.max_steps=8")
    losses = [r["loss"] for r in _records(run) if r["split"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    weights = load_file(str(run / "model.safetensors"))
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
def test_two_processes_with_dropout_resume_bit_for_bit(tmp_path):
    config = write_config(tmp_path / "d.yaml", model={"dropout": 0.3}, data={"max_samples": 800},
                          train={"max_steps": 4, "save_every": 2, "eval_every": 1000})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _torchrun_ok(2, "train", str(config), "--output-dir", str(straight), "--quiet")
    _torchrun_ok(2, "train", str(config), "--output-dir", str(resumed), "--quiet", "--set", "train.max_steps=2")
    _torchrun_ok(2, "train", "--resume", str(resumed), "--set", "train.max_steps=4", "--quiet")
    ours, theirs = (load_file(str(step_checkpoints(run)[-1] / "model.safetensors")) for run in (straight, resumed))
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_train_packed_rows_as_one_process_accumulating_two_batches(tmp_path, config, engine):
    """train.pack_length under DDP and FSDP: the packed batches (their rows, segments and positions)
    reach every process's model as one process's do."""
    one, two = tmp_path / "one", tmp_path / "two"
    packed = ["--set", "train.pack_length=64", "--set", f"train.parallel={engine}"]
    _one_process("train", str(config), "--output-dir", str(one), "--set", "train.grad_accum=2", *packed)
    _torchrun_ok(2, "train", str(config), "--output-dir", str(two), "--quiet", *packed)
    for checkpoint in step_checkpoints(one):
        _assert_same_weights(one, two, f"checkpoints/{checkpoint.name}")
    _assert_same_losses(one, two)


@pytest.mark.slow
def test_two_processes_train_with_bpe_dropout_and_resume_on_one(tmp_path):
    """Over gloo, each process draws its share of each epoch's segmentation and both train on the shares
    joined (test_train's test of the hand-over), their checkpoints keep it, and one process resumes."""
    config = write_config(tmp_path / "b.yaml", model={"dropout": 0.0}, data={"bpe_dropout": 0.3, "max_samples": 400},
                          train={"max_steps": None, "epochs": 3, "save_every": 2, "eval_every": 1000})
    run = tmp_path / "run"
    summary = json.loads(_torchrun_ok(2, "train", str(config), "--output-dir", str(run), "--quiet", "--json").stdout)
    assert summary["stop_reason"] == "reached train.epochs 3"
    assert all((checkpoint / "segmentation.safetensors").is_file() for checkpoint in step_checkpoints(run))
    _one_process("train", "--resume", str(run), "--set", "train.epochs=4", "--set", "train.grad_accum=2")
    assert [r["epoch"] for r in _records(run) if r["split"] == "train"][-1] == 3  # the fourth epoch


@pytest.mark.parametrize(("argv", "code", "skipped"), [(["--help"], 0, [0]), (["no-such-command"], 2, [])])
def test_a_process_that_left_its_group_and_succeeded_skips_the_teardown(monkeypatch, capsys, argv, code, skipped):
    """After the process group, a successful process skips the interpreter's teardown (gloo's threads
    can abort it) with its output flushed; a failing one, or one that never joined, ends as usual."""
    from tformer_cli import cli, parallel

    ended = []
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setattr(sys, "argv", ["tformer", *argv])
    for left, expected in ((False, []), (True, skipped)):
        monkeypatch.setattr(parallel, "left_group", left)
        with pytest.raises(SystemExit) as done:
            cli.main()
        assert done.value.code == code and ended == expected
    printed = capsys.readouterr()
    assert ("Usage" if code == 0 else "error: No such command 'no-such-command'") in printed.out + printed.err


def test_a_mistake_stops_every_process_with_one_line_each(tmp_path):
    config = write_config(tmp_path / "bad.yaml", data={"dataset": str(tmp_path / "missing")})
    # torchrun given 5 s before it stops the slower process: with other tests running beside this one
    # (make test's workers), that one could start 0.1 s behind the first and be stopped before its line
    result = _torchrun(2, "train", str(config), "--output-dir", str(tmp_path / "run"), "--quiet", monitor_interval=5)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors == 2 * [  # each finds it before the processes meet
        f"error: data.dataset: no such folder '{tmp_path / 'missing'}'; check the path (relative paths start "
        "from the current directory), or evaluate other files with eval --data-files"]
    assert "tformer_cli/" not in result.stderr  # no traceback from inside tformer (torchrun reports its own)


@pytest.mark.slow
def test_a_split_too_small_for_a_batch_a_process_stops_each_with_one_line(tmp_path):
    """Else the process without a batch would go through epochs without a step, forever."""
    config = write_config(tmp_path / "s.yaml", data={"max_samples": 3}, train={"max_tokens": 4096})
    result = _torchrun(2, "train", str(config), "--output-dir", str(tmp_path / "run"), "--quiet")
    errors = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert result.returncode != 0 and errors == {
        "error: the training split (3 pairs) makes fewer batches of train.max_tokens 4,096 than the 2 processes; "
        "lower train.max_tokens, or train with fewer processes"}, result.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_the_shares(rank: int, port: int, folder) -> None:
    """In a process of two: each one's share of a BPE-dropout draw, joined, saved by each process."""
    import torch.distributed as dist

    from tformer_cli.encoding import EncodedSplit, save_encoded
    from tformer_cli.parallel import Workers
    from tformer_cli.segmentation import _shares_joined

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        share = EncodedSplit([[5, 9, 2], [7, 2]], [[1, 6, 2], [1, 8, 8, 2]], [("a b", "c"), ("d", "é f")],
                             dropped_empty=1, dropped_long=2, truncated=3) if rank == 0 else \
            EncodedSplit([[4, 2]], [[1, 3, 2]], [("g", "h")], dropped_long=1)
        save_encoded(_shares_joined(Workers(rank, 2, rank, grouped=True), share), folder / f"rank-{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def test_bpe_dropouts_shares_reach_every_process_joined_in_order(tmp_path):
    """Each process's share of an epoch's segmentation goes to the others as tensors, not pickled: both
    processes end with the same ids, texts and counts, rank 0's pairs first."""
    from tformer_cli.encoding import read_encoded, split_counts

    torch.multiprocessing.spawn(_join_the_shares, args=(_free_port(), tmp_path), nprocs=2)
    ours, theirs = (read_encoded(tmp_path / f"rank-{rank}.safetensors") for rank in (0, 1))
    assert theirs == ours and split_counts(theirs) == {"dropped_empty": 1, "dropped_long": 3, "truncated": 3}
    assert list(ours.pairs) == [("a b", "c"), ("d", "é f"), ("g", "h")]
    assert list(ours.src) == [[5, 9, 2], [7, 2], [4, 2]] and list(ours.tgt) == [[1, 6, 2], [1, 8, 8, 2], [1, 3, 2]]


@pytest.mark.parametrize("engine, victim", [("ddp", 1), pytest.param("ddp", 0, marks=pytest.mark.slow),
                                            pytest.param("fsdp", 0, marks=pytest.mark.slow),
                                            pytest.param("fsdp", 1, marks=pytest.mark.slow)])
def test_a_killed_process_stops_the_others_within_seconds(tmp_path, engine, victim):
    """Without torchrun (which would stop the others itself): the processes that remain see the dead
    one in their next collective and exit with one line each, instead of waiting for it."""
    config = write_config(tmp_path / "k.yaml", data={"max_samples": 800},
                          train={"max_steps": 100000, "eval_every": 1000000, "log_every": 1, "parallel": engine})
    port, run = _free_port(), tmp_path / "run"
    processes = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        processes.append(subprocess.Popen([sys.executable, "-m", "tformer_cli", "train", str(config), "--output-dir",
                                           str(run), "--quiet"], env=env, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or len(_records(run)) < 3:  # training is under way
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
            time.sleep(0.2)
        processes[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = processes[1 - victim]
        stderr = survivor.communicate(timeout=60)[1]
        assert time.monotonic() - killed < 60
        errors = [line for line in stderr.splitlines() if line.strip()]
        assert survivor.returncode == 1 and len(errors) == 1, "\n".join(errors[-40:])
        assert errors[0].startswith(f"error: process {1 - victim}: another training process stopped (")
    finally:
        for p in processes:
            p.kill()
            p.wait()


def test_a_process_that_cannot_see_the_run_folder_says_where_it_must_be(tmp_path, trained_run):
    """With several machines, the processes beyond rank 0 read the tokenizer rank 0 wrote in the run
    folder: one that does not see it (a node-local --output-dir) says so in one line."""
    from tformer_cli.errors import CheckpointError
    from tformer_cli.parallel import Workers
    from tformer_cli.run_setup import run_vocabulary

    assert run_vocabulary(trained_run, Workers(rank=3, size=4)).src_size > 0
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        run_vocabulary(tmp_path, Workers())
    with pytest.raises(CheckpointError) as error:
        run_vocabulary(tmp_path, Workers(rank=3, size=4, local_rank=1))
    assert str(error.value) == (f"{tmp_path}: process 3 does not see the tokenizer that process 0 wrote there; with "
                                "several machines, put the run folder (--output-dir) on storage every machine sees")


def test_fsdp_refuses_processes_that_share_a_gpu(monkeypatch):
    """More processes on a node than GPUs: DDP shares them over gloo, FSDP stops before joining with
    one line that says what to run instead (on a machine without a GPU, CUDA's answers are stood in)."""
    from tformer_cli import parallel
    from tformer_cli.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    joined = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(UsageError, match=r"runs 2 processes on 1 GPU\(s\): run --nproc-per-node 1, or "
                                         r"train.parallel=ddp"):
        parallel.join(torch.device("cuda"), "fsdp")
    assert joined == []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    assert parallel.join(torch.device("cuda"), "ddp").grouped and joined == ["cpu:gloo,cuda:gloo"]
