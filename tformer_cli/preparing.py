"""The data cache filled in a child process: the vocabulary learned and the splits tokenised there, so
that the libraries, buffers and fragmented heap that reading and tokenising leave behind (~170 MiB for
Multi30k, benchmarks/README.md) go away with it, and training reads the cache.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tformer_cli.config import DataConfig
from tformer_cli.encoding import load_encoded, train_or_load_vocabulary
from tformer_cli.errors import DataError, first_line
from tformer_cli.tokenizer import Vocabulary

# Data capped below this many pairs (data.max_samples) is learnt and tokenised in the training process:
# what that leaves behind is small, and a child process's start (~2 s) would cost more than it saves
PREPARE_APART_FROM = 10_000


def worth_preparing_apart(cfg: DataConfig) -> bool:
    """Whether ``prepare_apart`` pays for this data: unless ``data.max_samples`` caps it below
    PREPARE_APART_FROM pairs."""
    return cfg.max_samples is None or cfg.max_samples >= PREPARE_APART_FROM


def prepare_apart(cfg: DataConfig, splits: Sequence[str], vocabulary: Path | None = None) -> list[str]:
    """Fill the cache in a child process (why: the module's docstring): the vocabulary learned
    (``train_or_load_vocabulary``; or, given, the one in the folder ``vocabulary``) and ``splits``
    encoded with it. Returns the notices it gave."""
    return _in_child(_prepare, cfg, tuple(splits), vocabulary)


def _prepare(cfg: DataConfig, splits: tuple[str, ...], vocabulary: Path | None) -> list[str]:
    notices: list[str] = []
    vocab = Vocabulary.load(vocabulary) if vocabulary else train_or_load_vocabulary(cfg, notices.append)
    for split in splits:
        load_encoded(cfg, split, vocab, notices.append)
    return notices


def _in_child(function: Callable, *args: Any) -> Any:
    """``function(*args)`` in a spawned process: what it returns, or what it raises raised here. A
    signal here (``Interrupted``) stops the child as well; a child that dies without answering (killed,
    out of memory) is a DataError."""
    from multiprocessing import get_context

    context = get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(send, function, args))  # not a daemon: it may spawn encoders
    child.start()
    send.close()
    try:
        returned, value = receive.recv()
    except EOFError:
        child.join()
        raise DataError(f"preparing the data failed: its process ended with exit code {child.exitcode} "
                        f"({_death(child.exitcode)})") from None
    except BaseException:
        child.terminate()  # it unwinds (_answer)
        raise
    finally:
        child.join()
        receive.close()
    if not returned:
        raise value
    return value


def _death(exitcode: int | None) -> str:
    """What a child's exit code says of how it ended, for the one-line error."""
    if exitcode is None or exitcode >= 0:
        return "its error is above"
    name = signal.Signals(-exitcode).name
    return "SIGKILL: out of memory?" if name == "SIGKILL" else f"{name}: a library it ran crashed"


def _answer(send, function: Callable, args: tuple) -> None:
    """In the child: run, and send back what came of it. Stopped by the parent (SIGTERM) or by Ctrl-C,
    it unwinds and exits as Python does, releasing what it made, instead of dying with it held."""
    signal.signal(signal.SIGTERM, _unwind)
    try:
        answer = (True, function(*args))
    except BaseException as exc:  # noqa: BLE001 - raised again in the parent
        answer = (False, exc)
    for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal would interrupt the unwinding
        signal.signal(signum, signal.SIG_IGN)
    try:
        send.send(answer)
    except OSError:  # the parent has stopped waiting: it was stopped itself
        pass
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its first line
        send.send((False, DataError(first_line(answer[1]))))


def _unwind(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
