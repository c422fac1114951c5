"""``tformer train --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT]``: the processes torchrun
would start, trained the same, with a mistake, machines that do not meet, a killed process and Ctrl-C
each told in one line and no launcher traceback."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import typer
from typer.testing import CliRunner

from conftest import parallel_config
from test_parallel import _assert_same_losses, _assert_same_weights, _free_port, _records
from tformer_cli import launch
from tformer_cli.cli import app
from tformer_cli.run_folder import step_checkpoints

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")


@pytest.fixture
def config(tmp_path):
    return parallel_config(tmp_path / "p.yaml")


def _tformer(*args: str, **popen) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key not in (launch.LAUNCHED, "LOCAL_RANK", "RANK")}
    return subprocess.Popen([sys.executable, "-m", "tformer_cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow  # the same training as test_parallel's torchrun test, which the quick suite runs
def test_two_launched_processes_train_as_one_process_accumulating_two_batches(tmp_path, config):
    one, two = tmp_path / "one", tmp_path / "two"
    assert CliRunner().invoke(app, ["train", str(config), "--output-dir", str(one), "--quiet", "--set",
                                    "train.grad_accum=2"]).exit_code == 0
    process = _tformer("train", str(config), "--output-dir", str(two), "--nproc-per-node", "2", "--json")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert json.loads(out)["step"] == 4  # rank 0 alone prints
    assert [c.name for c in step_checkpoints(two)] == [c.name for c in step_checkpoints(one)]
    for checkpoint in step_checkpoints(one):
        _assert_same_weights(one, two, f"checkpoints/{checkpoint.name}")
    _assert_same_losses(one, two)


@pytest.mark.slow
def test_two_machines_train_as_one_process_accumulating_two_batches(tmp_path, config):
    """Two launchers that meet at one endpoint (two machines, here both this one), a process each."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert CliRunner().invoke(app, ["train", str(config), "--output-dir", str(one), "--quiet", "--set",
                                    "train.grad_accum=2"]).exit_code == 0
    machine = ["train", str(config), "--output-dir", str(two), "--nnodes", "2", "--rdzv-endpoint",
               f"localhost:{_free_port()}", "--json"]
    launchers = [_tformer(*machine) for _ in range(2)]
    outputs = [launcher.communicate(timeout=300) for launcher in launchers]
    for launcher, (_, err) in zip(launchers, outputs):
        assert launcher.returncode == 0 and not err, err[-3000:]
    assert sorted(json.loads(out)["step"] for out, _ in outputs if out) == [4]  # rank 0 alone prints
    assert [c.name for c in step_checkpoints(two)] == [c.name for c in step_checkpoints(one)]
    for checkpoint in step_checkpoints(one):
        _assert_same_weights(one, two, f"checkpoints/{checkpoint.name}")
    _assert_same_losses(one, two)


def test_machines_that_do_not_all_come_are_one_line(tmp_path, config, monkeypatch):
    monkeypatch.setattr(launch, "JOIN_TIMEOUT_S", 2)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the launcher marks its environment for its processes
    endpoint = f"localhost:{_free_port()}"
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run"), "--nnodes", "2",
                                      "--rdzv-endpoint", endpoint])
    assert result.exit_code == 1
    assert result.output.splitlines() == [f"error: --nnodes 2: not all the machines came to {endpoint} within 2 s; "
                                          "start this command on each of them, with the same --nnodes and "
                                          "--rdzv-endpoint"]
    assert not (tmp_path / "run").exists()


QUIET_LAUNCHER = """
import datetime, os, sys
from tformer_cli import launch
from tformer_cli.cli import app


def launched(group, argv, run_dir):  # instead of starting processes: a store that goes away under its client
    import torch.distributed as dist

    print(os.environ.get(launch.TORCH_LOG))  # what the processes would get
    server = dist.TCPStore("localhost", 0, is_master=True, timeout=datetime.timedelta(seconds=2))
    client = dist.TCPStore("localhost", server.port, is_master=False, timeout=datetime.timedelta(seconds=2))
    del server
    try:
        client.get("key")
    except Exception:
        pass
    return 0


launch.launch = launched
app(sys.argv[1:])
"""


@pytest.mark.parametrize("machines, level, warned", [("2", None, False), ("1", None, True), ("2", "INFO", True)])
def test_on_several_machines_the_launchers_torch_keeps_its_cpp_warnings_to_itself(tmp_path, config, machines,
                                                                                 level, warned):
    """torch's C++ warnings (with stack frames) when a machine that held the rendezvous store left
    first: not from a launcher on several machines, unless the user asked for them; the processes get
    the level the user gave."""
    env = {key: value for key, value in os.environ.items() if key not in (launch.LAUNCHED, launch.TORCH_LOG)}
    if level:
        env[launch.TORCH_LOG] = level
    done = subprocess.run([sys.executable, "-c", QUIET_LAUNCHER, "train", str(config), "--output-dir",
                           str(tmp_path / "run"), "--nproc-per-node", "2", "--nnodes", machines, "--rdzv-endpoint",
                           "localhost:1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(level)]
    assert ("Connection was likely closed" in done.stderr) == warned, done.stderr[-3000:]


@pytest.mark.parametrize("args, message", [
    (["--set", "train.lr=-1"], "error: --set train.lr: must be > 0, got -1.0"),
    (["--nproc-per-node", "0"], "error: --nproc-per-node 0: give a number of processes (1 or more), or gpu"),
    (["--nproc-per-node", "two"], "error: --nproc-per-node two: give a number of processes (1 or more), or gpu"),
    (["--nproc-per-node", "3"], "error: --nproc-per-node 3: this machine has 2 CPU cores, and each training process "
                                "needs one; give at most 2"),
    # torch's launcher planned every process before starting one, its memory growing until it ran out
    (["--nproc-per-node", str(2 ** 64)], f"error: --nproc-per-node {2 ** 64}: this machine has 2 CPU cores, and each "
                                         "training process needs one; give at most 2"),
    pytest.param(["--nproc-per-node", "gpu"], "error: --nproc-per-node gpu: this machine has no GPU that torch can "
                 "see; give a number", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")),
    (["--device", "cuda:7"], None),  # the device is checked before any process starts
    (["--nnodes", "2"], "error: --nnodes 2: give --rdzv-endpoint HOST:PORT, where the machines meet (one of them, "
                        "the same on each)"),
    (["--nnodes", "0"], "error: --nnodes 0: give a number of machines (1 or more)"),
    (["--rdzv-endpoint", "node1:29500"], "error: --rdzv-endpoint: give --nnodes too, the number of machines that "
                                         "meet there"),
    (["--nnodes", "2", "--rdzv-endpoint", "node1"], "error: --rdzv-endpoint node1: give HOST:PORT (e.g. "
                                                    "node1:29500), where the machines meet"),
    (["--nnodes", "2", "--rdzv-endpoint", ":29500"], "error: --rdzv-endpoint :29500: give HOST:PORT (e.g. "
                                                     "node1:29500), where the machines meet"),
    (["--nnodes", "2", "--rdzv-endpoint", "node1:65536"], "error: --rdzv-endpoint node1:65536: give HOST:PORT (e.g. "
                                                          "node1:29500), where the machines meet"),
])
def test_a_mistake_is_one_line_before_any_process_starts(tmp_path, config, monkeypatch, args, message):
    monkeypatch.setattr(launch, "launch", lambda *args: pytest.fail("processes started"))
    monkeypatch.setattr("tformer_cli.tokenizer.usable_cpus", lambda: 2)  # launch imports it when it asks
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run"),
                                      "--nproc-per-node", "2", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ")
    assert message is None or lines[0] == message
    assert not (tmp_path / "run").exists()


UNSET = "train in one process, or start several with tformer train --nproc-per-node N (or torchrun)"


@pytest.mark.parametrize("environment, message", [
    ({"WORLD_SIZE": ""}, f"WORLD_SIZE='', where torchrun sets a whole number of at least 1; unset WORLD_SIZE to {UNSET}"),
    ({"WORLD_SIZE": "0"}, f"WORLD_SIZE='0', where torchrun sets a whole number of at least 1; unset WORLD_SIZE to "
                          f"{UNSET}"),
    ({"RANK": "one"}, f"RANK='one', where torchrun sets a whole number of at least 0; unset RANK to {UNSET}"),
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x', where torchrun sets a whole number of at least 1; unset "
                                f"LOCAL_WORLD_SIZE to {UNSET}"),
    # torch's rendezvous raised its ValueError for what was missing
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but not RANK, MASTER_ADDR or MASTER_PORT, which the processes need to meet; "
                          f"unset WORLD_SIZE to {UNSET}"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE=2 but not MASTER_PORT, which the "
                                                                     f"processes need to meet; unset WORLD_SIZE to {UNSET}"),
    # one process that took itself for a helper: it left the run folder to a first process that never came
    ({"RANK": "1"}, f"RANK=1 with WORLD_SIZE=1: a rank runs from 0 to WORLD_SIZE - 1; unset RANK to {UNSET}"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 with WORLD_SIZE=1: a rank runs from 0 to WORLD_SIZE - 1; unset LOCAL_RANK to "
                          f"{UNSET}"),
])
def test_a_torchrun_environment_set_wrong_is_one_line_before_any_work(tmp_path, config, monkeypatch, environment,
                                                                       message):
    """A job script that sets some of torchrun's variables, or sets them wrong."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 1 and result.output == f"error: the environment sets {message}\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["--nproc-per-node", "2"], ["--nnodes", "2", "--rdzv-endpoint", "node1:29500"]])
def test_a_process_that_torchrun_started_refuses_to_start_more(tmp_path, config, monkeypatch, args):
    monkeypatch.setenv("LOCAL_RANK", "0")
    result = CliRunner().invoke(app, ["train", str(config), *args])
    assert result.exit_code == 1 and result.output.startswith(f"error: {args[0]}: this process was started by "
                                                              "torchrun")


def test_the_processes_get_the_command_line_that_gives_the_same_options(tmp_path):
    """Every option of ``train`` is passed on (``launch.TRAIN_FLAGS``), and what the processes parse is
    what this process parsed."""
    command = typer.main.get_command(app).commands["train"]
    given = ["cfg.yaml", "--set", "train.lr=1", "--set", "model.d_model=64", "--device", "cpu", "--output-dir",
             str(tmp_path), "--overwrite", "--quiet", "--json", "--nproc-per-node", "4", "--nnodes", "2",
             "--rdzv-endpoint", "node1:29500"]
    options = command.make_context("train", list(given)).params
    assert set(options) == {*launch.TRAIN_FLAGS, "config", *launch.LAUNCH_FLAGS}
    passed = command.make_context("train", launch.command_line(options)).params
    assert passed == {**options, **dict.fromkeys(launch.LAUNCH_FLAGS)}  # the launcher's own: not passed on
    resumed = command.make_context("train", ["--resume", "runs/x"]).params
    assert launch.command_line(resumed) == ["--resume", "runs/x"]


def _start(tmp_path, config):
    """Two launched processes training for long, once their first steps are logged: (launcher, run folder)."""
    run = tmp_path / "run"
    process = _tformer("train", str(config), "--output-dir", str(run), "--nproc-per-node", "2", "--quiet", "--set",
                       "train.max_steps=100000", "--set", "train.save_every=100000", start_new_session=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() or len(_records(run)) < 3:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    return process, run


def _workers(launcher: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    return sorted(map(int, found))


@pytest.mark.slow
def test_a_killed_process_is_one_line_from_the_launcher(tmp_path, config):
    launcher, run = _start(tmp_path, config)
    try:
        workers = _workers(launcher)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        stderr = launcher.communicate(timeout=120)[1]
    finally:
        launcher.kill()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert launcher.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert lines[-1] == (f"error: training process 1 of 2 was killed by SIGKILL (the others were stopped); the run "
                         f"goes on from its last checkpoint with: tformer train --resume {run}")
    # the other process: one line of its own (its peer gone, or stopped by the launcher), no traceback
    assert len(lines) == 2 and lines[0].startswith("error: process 0: another training process stopped"), stderr


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_says_where_once(tmp_path, config):
    """The terminal's SIGINT reaches the launcher and both processes; the run stops after a step,
    checkpointed, and goes on from there."""
    launcher, run = _start(tmp_path, config)
    try:
        os.killpg(launcher.pid, signal.SIGINT)
        stderr = launcher.communicate(timeout=120)[1]
    finally:
        launcher.kill()
    (checkpoint,) = step_checkpoints(run)
    assert launcher.returncode == 128 + signal.SIGINT
    assert stderr.strip().splitlines() == [f"stopped by SIGINT; checkpoint {checkpoint}; resume with: tformer train "
                                           f"--resume {run}"]


@pytest.mark.slow
def test_a_signal_to_one_process_stops_them_all_and_rank_0_says_where(tmp_path, config):
    """A signal that reaches some processes only (those of one machine, or one killed by hand): every
    process stops after the same step, exits as if it had got the signal, and rank 0 says where the
    checkpoint is, though it got none itself."""
    launcher, run = _start(tmp_path, config)
    try:
        os.kill(_workers(launcher)[1], signal.SIGINT)
        stderr = launcher.communicate(timeout=120)[1]
    finally:
        launcher.kill()
    (checkpoint,) = step_checkpoints(run)
    assert launcher.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"stopped by SIGINT; checkpoint {checkpoint}; resume with: tformer train "
                                           f"--resume {run}"]


def test_a_signal_while_an_error_unwinds_reports_the_error(tmp_path, config, monkeypatch):
    """The launcher (or torchrun) stops the other processes with SIGTERM once one failed: one that is
    itself failing (its peer gone) says why, not "interrupted"."""
    import tformer_cli.parallel as parallel
    import tformer_cli.train as train
    from tformer_cli.errors import Interrupted, TformerError

    def fail(*args, **kwargs):
        raise TformerError("process 0: another training process stopped (RuntimeError); its own error says why")

    def stopped_while_leaving():
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(train, "train", fail)
    monkeypatch.setattr(parallel, "leave", stopped_while_leaving)
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert result.output.splitlines() == ["error: process 0: another training process stopped (RuntimeError); its "
                                          "own error says why"]


def test_one_process_trains_in_this_one(tmp_path, config, monkeypatch):
    monkeypatch.setattr(launch, "launch", lambda *args: pytest.fail("processes started"))
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "run"), "--quiet",
                                      "--nproc-per-node", "1"])
    assert result.exit_code == 0 and step_checkpoints(tmp_path / "run")
