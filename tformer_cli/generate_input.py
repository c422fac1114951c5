"""generate's input: the texts given as arguments, or standard input's lines (JSON lines with
``--json-input``) read as they arrive, so that a line typed or sent alone is answered at once and a
file or a full pipe is translated in batches. What cannot be read is a one-line error naming its line.
"""

from __future__ import annotations

import os
import select
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, BinaryIO

from tformer_cli.errors import UsageError

if TYPE_CHECKING:
    from tformer_cli.tokenizer import Vocabulary


def input_batches(texts: list[str] | None, prefix: str | None, json_input: bool, vocab: Vocabulary,
                  size: int) -> Iterator[list[tuple[str, str | None]]]:
    """generate's (text, prefix) inputs in batches: the texts given, all at once; else standard input's
    lines (JSON lines with ``json_input``), a batch the lines that have arrived, up to ``size``, so that a
    line typed or sent alone is answered at once."""
    if texts:
        return chunks([(text, prefix) for text in texts], len(texts))
    lines = InputLines(sys.stdin.buffer)
    inputs = json_lines(lines, prefix, vocab) if json_input else ((text, prefix) for text in lines)
    return chunks(inputs, size, lines.waiting)


class InputLines:
    """Standard input's lines as UTF-8 text without their line ends, read as they arrive, and whether the
    next one has yet to arrive (``waiting``). So ``generate`` answers each line at once when a person
    types it or a program writes one and waits for its translation, and translates a file or a full
    pipe in batches. A line that is not UTF-8 is a one-line error naming it."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        try:
            self.fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # in memory (a test's input): read as a file is
            self.fd = None
        self.ready: deque[bytes] = deque()  # whole lines read and not yet given
        self.partial: list[bytes] = []  # the start of the next line
        self.ended = False

    def __iter__(self) -> Iterator[str]:
        for number, raw in enumerate(self._raw_lines(), 1):
            try:  # a byte-order mark (a file saved by Notepad, say) is no part of the first line's text
                yield raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise UsageError(f"standard input, line {number}: not UTF-8 text (byte {exc.start + 1}); convert it "
                                 "first, e.g. iconv -t UTF-8") from None

    def waiting(self) -> bool:
        """Whether the next line is not here yet: none read ahead, and nothing to read without waiting."""
        if self.ready or self.ended or self.fd is None:
            return False
        try:
            readable, _, _ = select.select([self.fd], [], [], 0)
        except (OSError, ValueError):  # a descriptor select cannot watch (a Windows pipe): read in batches
            return False
        return not readable

    def _raw_lines(self) -> Iterator[bytes]:
        if self.fd is None:
            yield from self.stream
            return
        while True:
            while not self.ready and not self.ended:
                self._read()
            if not self.ready:
                return
            yield self.ready.popleft()

    def _read(self) -> None:
        """What the descriptor holds now (at least a byte, or the end), split into whole lines."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            self.ended = True
            if self.partial:  # a last line without its line end
                self.ready.append(b"".join(self.partial))
            return
        *lines, rest = data.split(b"\n")
        if lines:
            self.ready.append(b"".join(self.partial) + lines[0])
            self.ready.extend(lines[1:])
            self.partial = []
        if rest:
            self.partial.append(rest)


def json_lines(lines, default_prefix: str | None, vocab: Vocabulary):
    """(text, prefix) from JSON lines {"input": TEXT, "prefix": TEXT}; a line that is not one, or whose
    prefix the target vocabulary cannot spell, or with a key spelt almost like one of those two, is a
    one-line error naming it."""
    import difflib
    import json

    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"standard input, line {number}: not JSON ({exc.msg}); --json-input reads lines like "
                             '{"input": "text", "prefix": "start"}') from None
        others = record.keys() - {"input", "prefix"} if isinstance(record, dict) else set()
        for key in others:  # ignored ("id", ...), unless spelt almost like ours: a misspelt prefix would be lost
            close = difflib.get_close_matches(key, ["input", "prefix"], n=1)
            if close:
                raise UsageError(f"standard input, line {number}: unknown key {key!r}; did you mean {close[0]!r}?")
        if not isinstance(record, dict) or not isinstance(record.get("input"), str) \
                or not isinstance(record.get("prefix", ""), str):
            raise UsageError(f'standard input, line {number}: expected {{"input": TEXT}}, optionally with '
                             '"prefix": TEXT')
        for key in ("input", "prefix"):  # JSON may escape half a character (\ud800), which no text holds
            try:
                record.get(key, "").encode("utf-8")
            except UnicodeEncodeError as exc:
                raise UsageError(f"standard input, line {number}: {key}: character {exc.start + 1} is half of a "
                                 f"UTF-16 pair ({record[key][exc.start]!r}), not a character; escape whole "
                                 "characters") from None
        check_prefix(vocab, f"standard input, line {number}: prefix", record.get("prefix"))
        yield record["input"], record.get("prefix", default_prefix)


def check_prefix(vocab: Vocabulary, where: str, prefix: str | None) -> None:
    """A forced prefix must be spelt in the target vocabulary: an unknown token would drop out of the
    output, which then would not start with the prefix."""
    unknown = vocab.unknown_target_characters(prefix) if prefix else ""
    if unknown:
        raise UsageError(f"{where}: the run's target vocabulary has no token for {unknown!r}, so no output can "
                         "start with this prefix; leave those characters out")


def chunks(items: Iterable, size: int, waiting: Callable[[], bool] | None = None) -> Iterator[list]:
    """Lists of up to ``size`` items; a shorter one where ``waiting()`` says the next item has yet to come.
    An input line that cannot be read ends the lists after the items before it (so that generate's output
    holds a line for each input line up to the one the error names)."""
    chunk = []
    try:
        for item in items:
            chunk.append(item)
            if len(chunk) >= size or (waiting is not None and waiting()):
                yield chunk
                chunk = []
    except UsageError:
        if chunk:
            yield chunk
        raise
    if chunk:
        yield chunk
