r"""Several ranks' text on one stream in whole lines, each prefixed: at most one open line, of one writer, per
stream (two on one terminal share a :class:`Line`); a ``\\r`` starts a line, so a progress bar keeps its prefix."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Any, TextIO

_BREAK = re.compile(r"\r\n|\r|\n")
# Held while the reader writes or flushes a stream. Workers of a multi-node launch are forked while the reader
# runs; a fork waits for a write in progress, so a child never inherits sys.stdout locked by the reader.
_WRITING = threading.Lock()
os.register_at_fork(before=_WRITING.acquire, after_in_parent=_WRITING.release, after_in_child=_WRITING.release)


class Line:
    """The state of the line a text stream (or two streams on one terminal) is on."""

    def __init__(self) -> None:
        self.open_key: Any = None  # whose line is unfinished
        self.open_stream: TextIO | None = None  # where that line is
        self.at_start = True  # the next character of open_key starts a line (after \r)


class Sink:
    """A text stream on which at most one line, of one writer (``key``), is open at a time."""

    def __init__(self, stream: TextIO | None, line: Line | None = None) -> None:
        self.stream = stream
        self.line = line or Line()

    def write(self, key: Any, prefix: str, text: str) -> None:
        """Write ``key``'s ``text`` with ``prefix`` at its line starts, ending another writer's open line first."""
        if not text or self.stream is None:
            return
        line = self.line
        if line.open_key is not None and line.open_key != key:
            self.end()
        if line.open_key is None:
            line.at_start = True
        out, line.at_start = prefixed(text, prefix, line.at_start)
        line.open_key, line.open_stream = (None, None) if text.endswith("\n") else (key, self.stream)
        _write(self.stream, out)

    def end(self) -> None:
        """End the open line with a newline, on the stream where it is."""
        if self.line.open_stream is not None:
            _write(self.line.open_stream, "\n")
            flush(self.line.open_stream)
        self.line.open_key = self.line.open_stream = None


def consoles() -> tuple[Sink, Sink]:
    """Sinks for ``sys.stdout`` and ``sys.stderr``; one line state when both are the same file (a terminal)."""
    out, err = sys.stdout, sys.stderr
    try:
        same = os.path.sameopenfile(out.fileno(), err.fileno())
    except (AttributeError, OSError, ValueError):
        same = False
    line = Line()
    return Sink(out, line), Sink(err, line if same else None)


def prefixed(text: str, prefix: str, at_start: bool) -> tuple[str, bool]:
    r"""Return ``text`` with ``prefix`` at each line start (``\r`` starts one), and whether the next text does."""
    if not prefix or not text:
        return text, at_start
    if "\r" not in text:  # the common case, fast
        whole = (prefix if at_start else "") + text.replace("\n", "\n" + prefix)
        return (whole[: -len(prefix)], True) if text.endswith("\n") else (whole, False)
    out, pos = [], 0
    for match in _BREAK.finditer(text):
        piece = text[pos : match.start()]
        if at_start and (piece or match.group() != "\r"):
            out.append(prefix)
        out += [piece, match.group()]
        at_start, pos = True, match.end()
    if pos < len(text):
        out += [prefix, text[pos:]] if at_start else [text[pos:]]
        at_start = False
    return "".join(out), at_start


def _write(stream: TextIO, text: str) -> None:
    with _WRITING:
        try:
            stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except (OSError, ValueError):  # a closed console: the log files still get everything
            pass


def flush(stream: TextIO | None) -> None:
    with _WRITING, contextlib.suppress(Exception):
        if stream is not None:
            stream.flush()
