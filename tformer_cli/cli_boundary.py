"""The command line's one error boundary: what goes wrong in a command is one red line and an exit
code, not a traceback (``tformer --debug COMMAND`` shows it)."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

import typer
from typer.core import TyperGroup

from tformer_cli.errors import ConfigError, TformerError, UsageError, out_of_memory

try:  # recent typer keeps a copy of click of its own
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors


class ErrorBoundary(TyperGroup):
    """Turns a TformerError into red lines on stderr and exit code 1; `--debug` shows the traceback.
    A command line click cannot parse (an unknown command or option, a missing argument, a value that is
    not a number) is one red line too, with exit code 2, where typer would draw a box under the usage."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: ANN001
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:  # not standalone: click raises its parsing errors and returns the exit code of typer.Exit
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except getattr(click_errors, "NoArgsIsHelpError", ()):  # `tformer` alone: typer has printed the help
            sys.exit(2)
        except click_errors.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            _say(f"{exc.format_message().removesuffix('.')} ({self._command(ctx, args)} -h shows the usage)")
            sys.exit(exc.exit_code)
        except typer.Abort:  # end of input at a prompt
            _say("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def _command(self, ctx, args) -> str:  # noqa: ANN001
        """The command an error belongs to: its context's, or the command named on the command line."""
        if ctx is not None:
            return f"tformer {ctx.info_name}" if ctx.parent is not None else "tformer"
        named = next((arg for arg in (sys.argv[1:] if args is None else args) if arg in self.commands), None)
        return f"tformer {named}" if named else "tformer"

    def invoke(self, ctx):  # noqa: ANN001 - click's signature
        try:
            return super().invoke(ctx)
        except TformerError as exc:
            self._failed(ctx, exc)
        except OSError as exc:  # a file the user named cannot be read or written: no traceback for that
            if exc.filename is None or ctx.params.get("debug"):
                raise
            _say(f"{exc.filename}: {_os_reason(exc)}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt as exc:
            # a signal while an error unwinds (a launcher stopping the others once one failed): the error says why
            if isinstance(exc.__context__, TformerError):
                self._failed(ctx, exc.__context__)
            _say("interrupted")
            raise typer.Exit(128 + getattr(exc, "signum", signal.SIGINT)) from None
        except RuntimeError as exc:  # out of memory: say which setting to lower, not where torch ran out
            if not out_of_memory(exc) or ctx.params.get("debug"):
                raise
            where = "GPU" if type(exc).__name__ == "OutOfMemoryError" else "CPU"
            _say(f"out of {where} memory: {OUT_OF_MEMORY.get(ctx.invoked_subcommand, 'use a smaller model')}")
            raise typer.Exit(1) from None

    @staticmethod
    def _failed(ctx, exc: TformerError) -> NoReturn:  # noqa: ANN001
        """The error in one red line and exit code 1 (the traceback with --debug)."""
        if ctx.params.get("debug"):
            raise exc
        # a wrong command line or config is the same mistake in every process torchrun starts on a
        # machine: the first says it, not all eight
        if not (isinstance(exc, (ConfigError, UsageError)) and _beside_a_first_process()):
            _say(str(exc))
        raise typer.Exit(1) from None


def _beside_a_first_process() -> bool:
    """Whether torchrun started this process beside the machine's first (LOCAL_RANK above 0, among more
    than one), which says a mistake they share. Variables that are no numbers, or a stray LOCAL_RANK in
    one process, are a mistake of their own (``launch.check_torchrun_environment``), said."""
    from tformer_cli.launch import torchrun_variable

    try:
        return 0 < torchrun_variable("LOCAL_RANK") < torchrun_variable("WORLD_SIZE")
    except UsageError:
        return False


def _os_reason(exc: OSError) -> str:
    """What the OS refused, in words that say what to do where its own do not: a file in the way of a
    folder that a command makes (``--output x/y`` where ``x`` is a file) is "File exists" to the OS."""
    from tformer_cli.files import in_a_system_folder

    if isinstance(exc, (FileExistsError, NotADirectoryError)) and os.path.isfile(exc.filename):
        return "a file, where a folder is needed; move it or pick another path"
    path = os.path.abspath(str(exc.filename))
    if isinstance(exc, FileNotFoundError) and path.startswith(("/dev/fd/", "/proc/self/fd/")):
        return "no such open descriptor (the shell opens one for >(...) or N>); pick another path"
    if isinstance(exc, FileNotFoundError) and in_a_system_folder(path):  # a folder made in /proc, say
        return "its folder takes no new files (a system folder); pick another path"
    return exc.strerror


def _say(message: str) -> None:
    """``message`` as red lines on stderr (rich loads only when there is something to say)."""
    from tformer_cli.render import error_lines

    error_lines(message)


# What to lower when a command runs out of memory
OUT_OF_MEMORY = {
    "train": "lower train.max_tokens (with train.step_tokens a step keeps its tokens, in more batches; without, "
             "raise train.grad_accum to keep them); a run with checkpoints goes on with tformer train --resume "
             "RUN --set train.max_tokens=...",
    "eval": "lower --batch-size or --max-tokens (what is decoded together), or --beam-size",
    "generate": "lower --batch-size or --max-tokens (what is decoded together), or --beam-size or --nbest "
                "(hypotheses a sentence)",
    "inspect-attention": "use a shorter sentence",
}
