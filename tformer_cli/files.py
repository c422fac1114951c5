"""Writing files so that nothing acknowledged is lost: every file is written under a temporary name,
flushed to the disk and renamed into place, so a crash, a kill or a full disk leaves either the old
file or the new one, never a broken one, and no temporary file behind. Every file gets the mode a
new file gets (0o666 less the umask), whatever wrote it. JSON lines are strict JSON.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tformer_cli.errors import CheckpointError, first_line


def temporary_name(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it into place: ``.NAME.HOST.PID.tmp`` beside
    it. A name per process, so that two commands writing the same file at once (two evals into one
    file, jobs of a sweep filling one cache entry) each rename a whole file of their own into place,
    the later one winning, and neither renames or removes what the other is halfway through."""
    return path.with_name(f".{path.name}.{_host()}.{os.getpid()}.tmp")


# .NAME.HOST.PID.tmp; .NAME.tmp is an earlier tformer's
_TEMPORARY = re.compile(r"\.(?P<name>.+?)(?:\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+))?\.tmp", re.DOTALL)
ABANDONED_AFTER = 24 * 3600  # seconds: another machine's temporary unchanged this long was left by a killed write


def final_name(name: str) -> str | None:
    """The name that the temporary file ``name`` is renamed to (``.model.safetensors.HOST.123.tmp`` ->
    ``model.safetensors``); None if ``name`` is not one of tformer's temporary names."""
    found = _TEMPORARY.fullmatch(name)
    return found["name"] if found else None


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path (file or folder) to write; on success it replaces ``path`` durably.
    What killed writes of ``path`` left behind is removed first (``_remove_left_behind``).

    Raises:
        CheckpointError: the write failed (a full disk, say); ``path`` is as it was and the
            temporary file is removed.
    """
    path = Path(path)
    if path.is_symlink():  # a link someone made stays; what it points to is written
        path = path.resolve()
    tmp = temporary_name(path)
    _remove_left_behind(path)
    try:
        yield tmp
        _finish(tmp)
        if path.is_dir() and tmp.is_dir():  # a folder cannot be renamed over a full one
            _carry_over(path, tmp)
            _remove(path)  # only once the new one is written
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
            raise write_failed(path, exc, "nothing was replaced") from exc
        raise


def _remove_left_behind(path: Path) -> None:
    """Remove the temporary files of ``path`` that no process is writing: those that processes of this
    machine left when killed mid-write (a kill -9), this process's own, and another machine's (in a
    folder they share; a job restarted on a machine of another name) once unchanged for a day, as
    whether its writer still runs cannot be told."""
    try:
        siblings = list(path.parent.glob(f".{glob.escape(path.name)}.*tmp"))
    except OSError:
        return
    for sibling in siblings:
        found = _TEMPORARY.fullmatch(sibling.name)
        if found and found["name"] == path.name and _abandoned(sibling, found["host"], found["pid"]):
            _remove(sibling)


def _abandoned(temporary: Path, host: str | None, pid: str | None) -> bool:
    """Whether no process writes ``temporary`` any more, by the host and process its name holds."""
    if pid is None:  # an earlier tformer's .NAME.tmp
        return True
    if host == _host():
        return not _running(int(pid))
    try:
        return time.time() - temporary.stat().st_mtime > ABANDONED_AFTER
    except OSError:  # gone meanwhile
        return False


@functools.cache
def _host() -> str:
    """This machine's name, as a temporary file's name holds it: letters, digits and dashes."""
    import socket

    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _running(pid: int) -> bool:
    """Whether a process numbered ``pid`` other than this one runs on this machine; True where that
    cannot be told (Windows; another user's process)."""
    if pid == os.getpid():
        return False
    if os.name == "nt":  # os.kill(pid, 0) would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process; a number too large to be one
        return True
    return True


class WriteFailed(CheckpointError):
    """A write that failed: ``what`` (the file, the cause, what became of the file) and the ``fix`` its
    cause calls for, which a caller that knows more (a run: resume once fixed) can word its own way."""

    def __init__(self, path: Path, cause: str, outcome: str, fix: str, elsewhere: bool) -> None:
        self.what, self.fix = f"could not write {path} ({cause}); {outcome}", fix
        super().__init__(f"{self.what}: {fix}" + (" or pick another folder" if elsewhere else ""))


def write_failed(path: Path, exc: BaseException, outcome: str) -> WriteFailed:
    """The one-line error for a failed write of ``path``: the cause, ``outcome`` (what became of the
    file), and what to do, most often (torch's and safetensors' errors hide the errno) about a full disk."""
    code = error_number(exc)
    if code == errno.EISDIR:
        return WriteFailed(path, first_line(exc), outcome, "that is a folder; name a file", elsewhere=False)
    if code == errno.ENOENT and in_a_system_folder(path):
        return WriteFailed(path, first_line(exc), outcome, "its folder takes no new files (a system folder); pick "
                           "another folder", elsewhere=False)
    if code == errno.ENOENT:
        return WriteFailed(path, first_line(exc), outcome, "its folder was moved or deleted while the command ran; "
                           "leave it in place", elsewhere=True)
    fix = "make the folder writable" if code in (errno.EACCES, errno.EPERM, errno.EROFS) else "free space on the disk"
    return WriteFailed(path, first_line(exc), outcome, fix, elsewhere=True)


def in_a_system_folder(path: Path | str) -> bool:
    """Whether the nearest folder of ``path`` that exists is on a file system with no storage of its own
    (/proc, /sys), where making a file or a folder fails as if its folder were not there (ENOENT).
    Elsewhere ENOENT means that the folder, or the temporary being written in it, went away while the
    command ran."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.statvfs(folder).f_blocks == 0
    except (OSError, AttributeError):  # gone meanwhile; or no statvfs (Windows)
        return False


def error_number(exc: BaseException) -> int | None:
    """The OS error number behind ``exc``: an OSError's own, or the one that safetensors writes into
    its message as "(os error N)"; None if there is none."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def is_stream(path: Path) -> bool:
    """Whether ``path`` names a stream rather than a file to replace: /dev/stdout, a shell's ``>(...)``
    (/dev/fd/N), a named pipe, a device."""
    path = Path(path)
    if not path.exists():  # a descriptor that is not open (/dev/fd/9): a file to create, which fails at once
        return False
    # a pipe or device; or an open descriptor, whatever it is open on (a file, after the shell's >)
    return not path.is_file() or str(path.absolute()).startswith(("/dev/std", "/dev/fd/", "/proc/"))


def write_output(path: Path, text: str) -> None:
    """``text`` into a file the user named, replaced atomically; or into a stream (``is_stream``), which
    has no folder to hold a temporary: our own stdout or stderr through Python's (so that a redirected
    ``/dev/stdout`` is neither truncated nor written over by what is printed next), another appended to."""
    path = Path(path)
    if not is_stream(path):
        write_text_atomic(path, text)
        return
    named = os.stat(path)
    for stream in (sys.stdout, sys.stderr):
        try:
            same = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):  # replaced by a test's capture, or closed
            continue
        if (named.st_dev, named.st_ino) == (same.st_dev, same.st_ino):
            stream.write(text)
            stream.flush()
            return
    with open(path, "a", encoding="utf-8") as out:
        out.write(text)


def write_figure(figure, path: Path, dpi: float) -> None:  # noqa: ANN001 - a matplotlib Figure
    """Lay out a matplotlib figure as ``tight_layout`` lays it out and save it as ``replacing`` writes:
    whole or not at all, a full disk one ``CheckpointError``. The format is the name's extension (.png,
    .svg, .pdf). The layout is computed here, once: ``figure.tight_layout()`` would leave the figure a
    placeholder layout engine, for which savefig lays it out, drawing it whole, a second time. The layout
    measures the text on a canvas of the whole figure at the figure's dpi, laid out at 72 (or ``dpi`` where
    lower): at matplotlib's 100, the 6 maps of a 250-token sentence took a 1.2 GB canvas, or at 150 2.7 GB."""
    from matplotlib.layout_engine import TightLayoutEngine

    figure.set_dpi(min(dpi, 72))
    TightLayoutEngine().execute(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        figure.savefig(tmp, dpi=dpi, format=path.suffix[1:].lower())


def json_line(record: dict[str, Any]) -> str:
    """One line of strict JSON (``json_text``)."""
    return json_text(record) + "\n"


def json_text(data: Any, ascii_only: bool = True) -> str:
    """Strict JSON: NaN and infinities, which strict parsers reject, become null."""
    return json.dumps(_finite(data), allow_nan=False, ensure_ascii=ascii_only)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record; an unfinished last line (a write cut short by a kill) is dropped first."""
    with path.open("a+b") as f:
        if _ends_mid_line(f):
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - _TAIL))
            tail = f.read()
            cut = tail.rfind(b"\n")
            if cut >= 0 or end <= _TAIL:
                f.truncate(end - len(tail) + cut + 1)
            else:  # a line longer than the tail read: keep it, start a new one
                f.write(b"\n")
        f.write(json_line(record).encode())


def _ends_mid_line(f) -> bool:  # noqa: ANN001 - a binary file open for reading
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return False
    f.seek(end - 1)
    return f.read(1) != b"\n"


_TAIL = 1 << 16


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. An unfinished last line (a write cut short) is skipped.

    Raises:
        CheckpointError: a line that is not a JSON object, or a file that is not UTF-8 text.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {exc.start}); restore the file or delete it") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: cut short by a kill
                continue
            record = None
        if not isinstance(record, dict):
            raise CheckpointError(f"{path}, line {number}: not a JSON object; delete that line")
        records.append(record)
    return records


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _carry_over(old: Path, new: Path) -> None:
    """Move into the folder ``new`` whatever the folder ``old`` that it replaces holds and it does not:
    replacing a folder replaces the files written into it, not a user's files beside them."""
    for entry in old.iterdir():
        if not (new / entry.name).exists() and final_name(entry.name) is None:
            os.replace(entry, new / entry.name)


def _remove(path: Path) -> None:
    """Remove a temporary file or folder if it is there; a failure (a read-only disk) is the write's to report."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _finish(path: Path) -> None:
    """Ready a file, or a folder's files, to be renamed into place: the mode of a new file, and
    flushed to the disk. (safetensors 0.8 creates its files readable by their owner alone,
    safetensors#782, which would shut a run's other users out of its weights.)"""
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file() and not file.is_symlink():
            if file.stat().st_mode & 0o777 != new_file_mode():
                file.chmod(new_file_mode())
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@functools.cache
def new_file_mode() -> int:
    """The permissions ``open()`` gives a new file in this process: 0o666 less the umask."""
    umask = os.umask(0o022)  # reading the umask means setting it; it is put back at once
    os.umask(umask)
    return 0o666 & ~umask


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
