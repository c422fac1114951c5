"""User-facing errors: each message says what was wrong and how to fix it, in one line."""

import reprlib


class TformerError(Exception):
    """Base class for mistakes a user can fix; the CLI prints the message without a traceback."""


class ConfigError(TformerError):
    """A config file or override is invalid. One line per mistake."""


class DataError(TformerError):
    """A dataset could not be found, loaded or used as configured."""


class CheckpointError(TformerError):
    """A run folder or checkpoint is missing, incomplete or incompatible."""


class UsageError(TformerError):
    """A command-line argument is out of range or inconsistent."""


class DivergedError(TformerError):
    """Training diverged: the weights are no longer finite. The checkpoints saved before are kept."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether torch ran out of memory: its CUDA allocator raises OutOfMemoryError, its CPU allocator a
    RuntimeError saying so, and a tensor of 2^63 bytes or more one that its size overflowed."""
    return type(exc).__name__ == "OutOfMemoryError" or any(
        words in str(exc) for words in ("can't allocate memory", "Storage size calculation overflowed"))


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxtuple, _BRIEF.maxdict = 2, 4, 4, 4
_BRIEF.maxstring = _BRIEF.maxother = 60


def brief(value: object) -> str:
    """``repr(value)`` cut short, for a message that quotes what the user gave: a 10,000-entry list, or
    a YAML alias that stands for millions of entries, stays one short line (and is never built)."""
    return _BRIEF.repr(value)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type's name), for a one-line error about it."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the command; ``signum`` says which (exit status 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
