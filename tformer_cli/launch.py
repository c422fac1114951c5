"""``tformer train --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT]``: N training processes on
this machine (and on each of M machines, which meet at HOST:PORT), started and watched by torch's
elastic agent as ``torchrun --standalone --nproc-per-node N -m tformer_cli train ...`` starts them
(``torchrun --nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...`` on several machines), behind
tformer's error boundary.

The config and the command line are checked here first, so a mistake is one line before any process
starts. After that each process says what stopped it in one line of its own; this launcher adds a line
only for what a process cannot say itself (it was killed by a signal; the machines did not meet), and
none of torchrun's tracebacks. Processes that torchrun started train too (``tformer_cli.parallel``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tformer_cli.errors import TformerError, UsageError, first_line

# each option of ``tformer train`` by its parameter's name
TRAIN_FLAGS = {"resume": "--resume", "overrides": "--set", "device": "--device", "output_dir": "--output-dir",
               "overwrite": "--overwrite", "quiet": "--quiet", "json_output": "--json"}
LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "rdzv_endpoint")  # this launcher's: not passed on to the processes
LAUNCHED = "TFORMER_LAUNCHED"  # in the environment of the processes this launcher starts
STOP_TIMEOUT_S = 120  # how long a process that was told to stop may take to checkpoint before it is killed
JOIN_TIMEOUT_S = 600  # how long the machines wait at --rdzv-endpoint for each other (torchrun's default)
TORCH_LOG = "TORCH_CPP_LOG_LEVEL"  # read by torch as it loads
_quietened = False  # whether this launcher set TORCH_LOG for its own torch


@dataclass(frozen=True)
class Group:
    """Where training runs: ``processes`` processes on each of ``machines`` machines, which meet at
    ``endpoint`` (HOST:PORT; None on one machine)."""

    processes: int = 1
    machines: int = 1
    endpoint: str | None = None

    @property
    def size(self) -> int:
        return self.processes * self.machines


def training_group(nproc_per_node: str | None, nnodes: int | None, rdzv_endpoint: str | None) -> Group:
    """The group that ``tformer train``'s --nproc-per-node, --nnodes and --rdzv-endpoint ask for.

    Raises:
        UsageError: as ``process_count`` does; --nnodes under 1; several machines without a HOST:PORT
            to meet at, or --rdzv-endpoint without --nnodes; several machines asked of a process that
            torchrun started.
    """
    processes = process_count(nproc_per_node) if nproc_per_node is not None else 1
    if nnodes is None and rdzv_endpoint is not None:
        raise UsageError("--rdzv-endpoint: give --nnodes too, the number of machines that meet there")
    machines = 1 if nnodes is None else nnodes
    if machines < 1:
        raise UsageError(f"--nnodes {nnodes}: give a number of machines (1 or more)")
    if rdzv_endpoint is None:
        if machines > 1:
            raise UsageError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, where the machines meet (one "
                             "of them, the same on each)")
        return Group(processes)
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {rdzv_endpoint}: give HOST:PORT (e.g. node1:29500), where the machines meet")
    if machines > 1 and "LOCAL_RANK" in os.environ:
        raise UsageError("--nnodes: this process was started by torchrun, which says how many machines; give the "
                         "number to torchrun or to tformer train, not both")
    return Group(processes, machines, rdzv_endpoint)


def quieten_torch(nnodes: int | None) -> None:
    """On several machines, before torch loads: this launcher's torch logs C++ errors only. Its
    rendezvous client warns, with C++ stack frames, whenever the machine that held the rendezvous store
    has left first (one interrupted, or failed), which the processes and launchers say in one line each.
    A level the user set is kept; the processes get the environment as it was (``launch_training``)."""
    global _quietened
    if nnodes is not None and nnodes > 1 and TORCH_LOG not in os.environ and "torch" not in sys.modules:
        os.environ[TORCH_LOG] = "ERROR"
        _quietened = True


def process_count(processes: str) -> int:
    """--nproc-per-node's processes: a number, or "gpu" for one a GPU.

    Raises:
        UsageError: neither a number of 1 or more nor "gpu"; "gpu" on a machine without one; more
            processes than CPU cores; more than one asked of a process that torchrun started.
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
    from tformer_cli.tokenizer import usable_cpus  # here: the module loads tokenizers, which other commands skip

    if count > (cores := usable_cpus()):  # torch's launcher would plan every process before starting one
        raise UsageError(f"--nproc-per-node {count}: this machine has {cores} CPU cores, and each training process "
                         f"needs one; give at most {cores}")
    if count > 1 and "LOCAL_RANK" in os.environ:
        raise UsageError("--nproc-per-node: this process was started by torchrun, which says how many; give the "
                         "number to torchrun or to tformer train, not both")
    return count


def launch_training(group: Group, options: dict[str, Any], debug: bool = False) -> int:
    """``tformer train`` with ``options`` (the command's parameters by name) in this machine's processes
    of ``group``: the command checked here first, so that a mistake is one line before any process
    starts, then ``launch``. Returns the exit status to end with.

    Raises:
        ConfigError, CheckpointError, UsageError: as ``prepare_run`` raises them.
    """
    from tformer_cli.runs import prepare_run

    _, run_dir = prepare_run(options["config"], options["resume"], list(options["overrides"] or []),
                             options["output_dir"], options["overwrite"], main=False, device=options["device"])
    if _quietened:  # torch has loaded: the processes log as they would have
        del os.environ[TORCH_LOG]
    return launch(group, ["--debug"] * debug + ["train", *command_line(options)], run_dir)


def command_line(options: dict[str, Any]) -> list[str]:
    """The arguments of ``tformer train`` that give ``options``, the launcher's own left out."""
    args = [str(options["config"])] if options["config"] is not None else []
    for name, value in options.items():
        if name == "config" or name in LAUNCH_FLAGS or value is None or value is False:
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
    return torchrun_variable("RANK")


# what torchrun tells the processes it starts, and each value in a process it did not start
TORCHRUN_VARIABLES = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}


def torchrun_variable(name: str) -> int:
    """torchrun's variable ``name`` (one of TORCHRUN_VARIABLES) from the environment, or its value in a
    process that torchrun did not start.

    Raises:
        UsageError: it is set to anything but a whole number (at least 1 for the sizes).
    """
    text = os.environ.get(name)
    least = TORCHRUN_VARIABLES[name]  # a size counts at least this process, a rank starts at 0
    if text is None:
        return least
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise UsageError(f"the environment sets {name}={text!r}, where torchrun sets a whole number of at least "
                         f"{least}; {_unset(name)}")
    return value


def check_torchrun_environment() -> None:
    """The variables that torchrun sets, as a process it started reads them, before anything is read or
    written: whole numbers, a rank below the size, and beside a size above 1 the rest of what the
    processes need to meet (RANK, MASTER_ADDR, MASTER_PORT). A shell or a job script that sets only some
    of them would otherwise fail in torch's rendezvous, or train a process that takes itself for
    another's helper and leaves the run folder to it.

    Raises:
        UsageError: naming the variable and what to do.
    """
    size = torchrun_variable("WORLD_SIZE")
    torchrun_variable("LOCAL_WORLD_SIZE")  # a whole number too
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if size > 1 and missing:
        names = ", ".join(missing[:-1]) + " or " * (len(missing) > 1) + missing[-1]
        raise UsageError(f"the environment sets WORLD_SIZE={size} but not {names}, which the processes need to "
                         f"meet; {_unset('WORLD_SIZE')}")
    for name in ("RANK", "LOCAL_RANK"):  # ranks of this process among all of them
        if (rank := torchrun_variable(name)) >= size:
            raise UsageError(f"the environment sets {name}={rank} with WORLD_SIZE={size}: a rank runs from 0 to "
                             f"WORLD_SIZE - 1; {_unset(name)}")


def _unset(name: str) -> str:
    """What to do about a torchrun variable set wrong in the environment."""
    return (f"unset {name} to train in one process, or start several with tformer train --nproc-per-node N "
            "(or torchrun)")


def launch(group: Group, argv: list[str], run_dir: Path) -> int:
    """Run ``python -m tformer_cli *argv`` in this machine's processes of ``group`` and wait for them all
    (on several machines, once all have met at its endpoint). Returns the exit status to end with: 0;
    the status of the process that failed first (which said why); 128 + a signal that killed it (said
    here); or 128 + a signal that stopped this launcher (passed on to the processes, which checkpoint and
    say where).

    Raises:
        TformerError: the machines did not meet: not all came within ``JOIN_TIMEOUT_S``, or the endpoint
            cannot be reached.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tformer_cli.render import error_lines

    for name in list(logging.root.manager.loggerDict):  # the agent's reports repeat what the processes say
        if name.startswith("torch.distributed.elastic"):  # (each of its loggers has a level of its own)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED] = "1"
    # torchrun's default is 1 thread a process; the machine's cores shared out keeps a CPU run as fast
    from tformer_cli.tokenizer import usable_cpus

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // group.processes)))
    # the machines' agents meet in the run's name: two runs given one endpoint by mistake do not mix
    run_id = f"tformer-{run_dir.name}" if group.endpoint else str(uuid.uuid4())
    config = LaunchConfig(min_nodes=group.machines, max_nodes=group.machines, nproc_per_node=group.processes,
                          run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=group.endpoint or "localhost:0",
                          rdzv_configs={"join_timeout": JOIN_TIMEOUT_S}, max_restarts=0,
                          shutdown_timeout=STOP_TIMEOUT_S)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tformer_cli", *argv)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        again = " on every machine, with the same --nnodes and --rdzv-endpoint" if group.machines > 1 else ""
        error_lines(f"training process {rank} of {group.size} was killed by {failure.signal_name()} (the others "
                    f"were stopped); the run goes on from its last checkpoint with: tformer train --resume "
                    f"{run_dir}{again}")
        return 128 - failure.exitcode
    except SignalException as stopped:
        return 128 + signal.Signals(stopped.sigval)
    except RendezvousTimeoutError:
        raise TformerError(f"--nnodes {group.machines}: not all the machines came to {group.endpoint} within "
                           f"{JOIN_TIMEOUT_S} s; start this command on each of them, with the same --nnodes and "
                           "--rdzv-endpoint") from None
    except RendezvousConnectionError:
        raise TformerError(f"--rdzv-endpoint {group.endpoint}: cannot be reached from here; give a free port on "
                           "one of the machines, by a name or address that each of them can reach") from None
    except RendezvousError as error:  # the rendezvous closed or its state was lost: said as torch says it
        raise TformerError(f"--rdzv-endpoint {group.endpoint}: {first_line(error)}") from None
    return 0
