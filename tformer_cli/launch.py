"""``tformer train --nproc-per-node N``: N training processes on this machine, started and watched by
torch's elastic agent as ``torchrun --standalone --nproc-per-node N -m tformer_cli train ...`` starts
them, behind tformer's error boundary.

The config and the command line are checked here first, so a mistake is one line before any process
starts. After that each process says what stopped it in one line of its own; this launcher adds a line
only for what a process cannot say itself (it was killed by a signal), and none of torchrun's
tracebacks. Several machines: torchrun itself (``tformer_cli.parallel``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from tformer_cli.errors import UsageError

# each option of ``tformer train`` by its parameter's name
TRAIN_FLAGS = {"resume": "--resume", "overrides": "--set", "device": "--device", "output_dir": "--output-dir",
               "overwrite": "--overwrite", "quiet": "--quiet", "json_output": "--json"}
LAUNCHED = "TFORMER_LAUNCHED"  # in the environment of the processes this launcher starts
STOP_TIMEOUT_S = 120  # how long a process that was told to stop may take to checkpoint before it is killed


def process_count(processes: str) -> int:
    """--nproc-per-node's processes: a number, or "gpu" for one a GPU.

    Raises:
        UsageError: neither a number of 1 or more nor "gpu"; "gpu" on a machine without one; more than
            one process asked of a process that torchrun started.
    """
    if processes == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--nproc-per-node gpu: this machine has no GPU that torch can see; give a number")
        count = torch.cuda.device_count()
    elif processes.isdigit() and int(processes) >= 1:
        count = int(processes)
    else:
        raise UsageError(f"--nproc-per-node {processes}: give a number of processes (1 or more), or gpu")
    if count > 1 and "LOCAL_RANK" in os.environ:
        raise UsageError("--nproc-per-node: this process was started by torchrun, which says how many; give the "
                         "number to torchrun or to tformer train, not both")
    return count


def launch_training(processes: int, options: dict[str, Any], debug: bool = False) -> int:
    """``tformer train`` with ``options`` (the command's parameters by name) in ``processes`` processes:
    the command checked here first, so that a mistake is one line before any process starts, then
    ``launch``. Returns the exit status to end with.

    Raises:
        ConfigError, CheckpointError, UsageError: as ``prepare_run`` raises them.
    """
    from tformer_cli.runs import prepare_run

    _, run_dir = prepare_run(options["config"], options["resume"], list(options["overrides"] or []),
                             options["output_dir"], options["overwrite"], main=False, device=options["device"])
    return launch(processes, ["--debug"] * debug + ["train", *command_line(options)], run_dir)


def command_line(options: dict[str, Any]) -> list[str]:
    """The arguments of ``tformer train`` that give ``options``, --nproc-per-node left out."""
    args = [str(options["config"])] if options["config"] is not None else []
    for name, value in options.items():
        if name in ("config", "nproc_per_node") or value is None or value is False:
            continue
        flag = TRAIN_FLAGS[name]
        if value is True:
            args.append(flag)
        else:  # a value, or a list of them (--set, once each)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                args += [flag, str(item)]
    return args


def launched() -> bool:
    """Whether this process is one that ``launch`` started (it trains, whatever --nproc-per-node says)."""
    return LAUNCHED in os.environ


def launched_rank() -> int:
    """This process's rank as torchrun or ``launch`` set it (0 when launched by neither), without importing
    torch."""
    return int(os.environ.get("RANK", "0"))


def launch(processes: int, argv: list[str], run_dir: Path) -> int:
    """Run ``python -m tformer_cli *argv`` in ``processes`` processes of one group on this machine and
    wait for them all. Returns the exit status to end with: 0; the status of the process that failed
    first (which said why); 128 + a signal that killed it (said here); or 128 + a signal that stopped
    this launcher (passed on to the processes, which checkpoint and say where)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tformer_cli.render import error_lines

    for name in list(logging.root.manager.loggerDict):  # the agent's reports repeat what the processes say
        if name.startswith("torch.distributed.elastic"):  # (each of its loggers has a level of its own)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED] = "1"
    # torchrun's default is 1 thread a process; the machine's cores shared out keeps a CPU run as fast
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // processes)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          shutdown_timeout=STOP_TIMEOUT_S)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tformer_cli", *argv)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        error_lines(f"training process {rank} of {processes} was killed by {failure.signal_name()} (the others were "
                    f"stopped); the run goes on from its last checkpoint with: tformer train --resume {run_dir}")
        return 128 - failure.exitcode
    except SignalException as stopped:
        return 128 + signal.Signals(stopped.sigval)
    return 0
