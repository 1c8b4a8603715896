"""Per-rank output in a worker: a ``[rank N]`` prefix, console filtering, and per-rank log files."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO


class RankStream(io.TextIOBase):
    """A text stream that writes whole lines, prefixed, to the console stream and/or a log file.

    Partial lines wait in a buffer until their newline (or :meth:`close`), so lines of different ranks
    never interleave mid-line.
    """

    def __init__(self, console: TextIO | None, log: TextIO | None, prefix: str) -> None:
        super().__init__()
        self._console = console
        self._log = log
        self._prefix = prefix
        self._pending = ""

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._console or self._log, "encoding", None) or "utf-8"

    def fileno(self) -> int:
        """The console stream's descriptor (writes through it bypass the prefix), for faulthandler and
        subprocess; raises ``io.UnsupportedOperation`` when this rank's console output is dropped."""
        if self._console is None:
            raise io.UnsupportedOperation("this rank's console output is dropped (console_ranks)")
        return self._console.fileno()

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self._emit("".join(f"{self._prefix}{line}\n" for line in lines))
        return len(text)

    def _emit(self, text: str) -> None:
        for stream in (self._console, self._log):
            if stream is not None:
                stream.write(text)
                stream.flush()

    def flush(self) -> None:
        for stream in (self._console, self._log):
            if stream is not None:
                stream.flush()

    def close(self) -> None:
        if self._pending:
            self._emit(f"{self._prefix}{self._pending}\n")
            self._pending = ""
        super().close()


@contextlib.contextmanager
def rank_output(rank: int, prefix: bool, console_ranks: frozenset[int] | None, log_dir: str | None) -> Iterator[None]:
    """Route this worker's ``sys.stdout``/``sys.stderr`` as the options say, for the duration of the block.

    Only writes through Python's streams are routed; a C library writing to file descriptors 1 and 2
    directly (e.g. NCCL's logs) reaches the console as it is.
    """
    if not prefix and console_ranks is None and log_dir is None:
        yield
        return
    to_console = console_ranks is None or rank in console_ranks
    label = f"[rank {rank}] " if prefix else ""
    log = None
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        append = restart not in ("", "0")  # a restart keeps the failed attempt's output
        path = os.path.join(log_dir, f"rank{rank}.log")
        log = open(path, "a" if append else "w", buffering=1, encoding="utf-8")  # noqa: SIM115
        if append:
            log.write(f"--- restart {restart} (TORCHELASTIC_RESTART_COUNT={restart}) ---\n")
    saved = sys.stdout, sys.stderr
    streams = [RankStream(original if to_console else None, log, label) for original in saved]
    sys.stdout, sys.stderr = streams
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for stream in streams:
            stream.close()
        if log is not None:
            log.close()
