r"""The parent's side of per-rank output: one pipe per rank and stream, drained by one thread into whole, prefixed
lines on the ``sys.stdout``/``stderr`` current at launch (a Jupyter cell shows them) and ``log_dir/rank{N}.log``."""

from __future__ import annotations

import codecs
import contextlib
import contextvars
import fcntl
import os
import selectors
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from mplaunch._errors import LaunchRefusedError
from mplaunch._output.lines import Sink, consoles, flush
from mplaunch._output.rank_streams import RANK_MARK, on_fd
from mplaunch._wire.inherited import InheritedFd
from mplaunch._wire.spec import RankFds

if TYPE_CHECKING:
    from mplaunch._wire.spec import LaunchSpec

HOLD = 0.1  # seconds a rank's text waits for another rank's open line to end before that line is cut
DRAIN = 0.5  # seconds to wait, after the workers are reaped, for processes they left to close the pipes
_PIPE_SIZE = 1 << 20  # bytes of pipe buffer asked for, so a rank rarely waits on the reader
_READ = 1 << 16
_BATCH = 0.002  # seconds the reader lets text gather in the pipes before reading
DEFAULT_PREFIX = "[rank {rank}] "


def should_route(prefix: bool | str, console_ranks: frozenset[int] | None, log_dir: str | None) -> bool:
    """Return whether output goes through the parent: an option asks, or ``sys.stdout``/``stderr`` is not fd 1/2."""
    if prefix or console_ranks is not None or log_dir is not None:
        return True
    return not (on_fd(sys.stdout, 1) and on_fd(sys.stderr, 2))


class _Source:
    """One pipe: a rank's stdout or stderr."""

    def __init__(self, fd: int, rank: int | None, local_rank: int, err: bool) -> None:
        self.fd, self.rank, self.local_rank, self.err = fd, rank, local_rank, err
        self.pid: int | None = None  # announced by a multi-node worker
        self.node_rank = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.carry = b""  # an incomplete rank mark
        self.pending = ""  # decoded text the console has not taken yet
        self.since = 0.0  # when the oldest pending text arrived


class Pump:
    """Pipes for one node's ranks and the thread that drains them; a rank of ``None`` is announced (multi-node)."""

    def __init__(
        self,
        ranks: list[int | None],
        prefix: bool | str,
        console_ranks: frozenset[int] | None,
        log_dir: str | None,
        restart: int = 0,
    ) -> None:
        self.console_ranks, self.log_dir, self.restart = console_ranks, log_dir, restart
        self.template = DEFAULT_PREFIX if prefix is True else prefix or None
        self.pids: dict[int, int] = {}  # local rank -> pid, noted by the launch as each worker starts
        self.consoles = consoles()
        self.logs: dict[int, tuple[TextIO, Sink]] = {}
        self.sources: list[_Source] = []
        self.writers: list[int] = []
        self.fds: list[RankFds] = []
        self._finishing = False
        self._thread: threading.Thread | None = None
        self._context: contextvars.Context | None = None  # where text goes from now on (see retarget)
        self._syncs: list[threading.Event] = []  # callers of sync() waiting
        self._open_logs([rank for rank in ranks if rank is not None])
        self._wake_r = self._wake_w = -1
        try:
            self._wake_r, self._wake_w = os.pipe()
            for local_rank, rank in enumerate(ranks):
                ends = []
                for err in (False, True):
                    read, write = os.pipe()
                    self.sources.append(_Source(read, rank, local_rank, err))
                    self.writers.append(write)
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
                    os.set_blocking(read, False)
                    ends.append(InheritedFd(write))
                self.fds.append(RankFds(ends[0], ends[1], routed=True, announce=rank is None))
        except BaseException:  # the open-files limit, at any pipe: none of them is left open
            self._close_writers()
            self._release()
            raise

    def _open_logs(self, ranks: list[int]) -> None:
        """Create ``log_dir`` and the known ranks' files, before any worker starts."""
        if self.log_dir is None:
            return
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            for rank in ranks:
                self._log(rank, check=True)
        except OSError as error:
            for file, _ in self.logs.values():
                file.close()
            raise LaunchRefusedError(
                f"cannot write the per-rank log files in log_dir={self.log_dir!r}: {error}. "
                "Pass a directory this process can create and write to."
            ) from error

    def start(self, keep_writers: bool = False) -> None:
        """Start draining once the workers started; ``keep_writers``: a multi-node agent restarts on these pipes."""
        if not keep_writers:
            self._close_writers()
        context = contextvars.copy_context()  # ipykernel finds the cell of a thread's output there
        self._thread = threading.Thread(target=context.run, args=(self._loop,), name="mplaunch-output", daemon=True)
        self._thread.start()

    def retarget(self) -> None:
        """Write from now on to the caller's current streams and context: a warm pump outlives its cell."""
        self._context = contextvars.copy_context()
        if (sys.stdout, sys.stderr) != (self.consoles[0].stream, self.consoles[1].stream):
            self.consoles = consoles()

    def sync(self, timeout: float = 1.0) -> None:
        """Write out, within ``timeout`` seconds, what the ranks wrote so far (a warm call's, before it returns)."""
        if self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()
        self._syncs.append(done)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")
        done.wait(timeout)

    def close(self) -> None:
        """Drain the pipes (at most :data:`DRAIN` seconds after the workers are reaped), write out and close all."""
        self._close_writers()
        self._finishing = True
        os.write(self._wake_w, b"x")
        try:
            if self._thread is not None:
                self._thread.join()
            else:
                self._finish(self.sources)
        finally:
            self._release()

    def _release(self) -> None:
        for fd in (self._wake_r, self._wake_w, *(s.fd for s in self.sources)):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for file, _ in self.logs.values():
            with contextlib.suppress(OSError):
                file.close()

    def _close_writers(self) -> None:
        for fd in self.writers:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.writers = []

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        open_sources = {s.fd: s for s in self.sources}
        for source in self.sources:
            selector.register(source.fd, selectors.EVENT_READ, source)
        deadline = None
        while open_sources:
            if self._finishing and deadline is None:
                deadline = time.monotonic() + DRAIN
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            timeouts = [s.since + HOLD - now for s in self.sources if s.pending]
            if deadline is not None:
                timeouts.append(deadline - now)
            ready = selector.select(max(0.0, min(timeouts)) if timeouts else None)
            if ready and not self._finishing:
                time.sleep(_BATCH)  # let writers add more: fewer, larger reads (a rank printing fast waits less)
            for key, _ in ready:
                if key.data is None:
                    os.read(self._wake_r, 64)
                elif not self._read(key.data, _PIPE_SIZE):
                    selector.unregister(key.fd)
                    del open_sources[key.fd]
            syncs, self._syncs = self._syncs, []
            for source in open_sources.values() if syncs else ():
                self._read(source, _PIPE_SIZE)
            if self._context is None:
                self._to_consoles(final=bool(syncs))
            else:
                self._context.run(self._to_consoles, bool(syncs))
            for done in syncs:
                done.set()
        selector.close()
        self._finish(list(open_sources.values()))

    def _finish(self, still_open: list[_Source]) -> None:
        """Take what pipes held by leftover processes contain, then write everything out."""
        for source in still_open:
            self._read(source, _PIPE_SIZE)
        for source in self.sources:
            self._take(source, source.decoder.decode(source.carry, final=True))
            source.carry = b""
        self._to_consoles(final=True)
        for sink in self.consoles:
            sink.end()
            flush(sink.stream)
        for file, sink in self.logs.values():
            sink.end()
            flush(file)

    def _read(self, source: _Source, limit: int) -> bool:
        """Read what the pipe holds now, up to about ``limit`` bytes; False at its end."""
        total = 0
        while total < limit:
            try:
                data = os.read(source.fd, _READ)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            total += len(data)
            self._bytes(source, data)
        return True

    def _bytes(self, source: _Source, data: bytes) -> None:
        """Decode ``data``; a rank mark sets the rank of what follows."""
        data = source.carry + data
        while (start := data.find(RANK_MARK)) >= 0:
            end = data.find(b"\x00", start + len(RANK_MARK))
            if end < 0:
                break
            self._take(source, source.decoder.decode(data[:start]))
            self._write(source)  # what came before belongs to the old rank
            source.rank, source.pid, source.node_rank = _announced(data[start + len(RANK_MARK) : end])
            self._log(source.rank)
            data = data[end + 1 :]
        if start < 0:
            cut = data.rfind(b"\x00")
            start = cut if cut >= 0 and RANK_MARK.startswith(data[cut:]) else len(data)
        data, source.carry = data[:start], data[start:]
        self._take(source, source.decoder.decode(data))

    def _label(self, source: _Source) -> tuple[int, str]:
        rank = source.rank if source.rank is not None else source.local_rank
        if self.template is None:
            return rank, ""
        pid = source.pid if source.pid is not None else self.pids.get(source.local_rank, 0)
        return rank, self.template.format(rank=rank, local_rank=source.local_rank, node_rank=source.node_rank, pid=pid)

    def _take(self, source: _Source, text: str) -> None:
        if not text:
            return
        rank, label = self._label(source)
        log = self.logs.get(rank) if source.rank is not None else None
        if log is not None:
            log[1].write(source.err, label, text)
        if self.console_ranks is None or rank in self.console_ranks:
            if not source.pending:
                source.since = time.monotonic()
            source.pending += text

    def _to_consoles(self, final: bool) -> None:
        """Write pending text to the consoles, never into another rank's open line."""
        now = time.monotonic()
        for source in sorted((s for s in self.sources if s.pending), key=lambda s: s.since):
            if final or self.consoles[source.err].line.open_key in (None, source.fd) or now - source.since >= HOLD:
                self._write(source)
        for sink in self.consoles:
            flush(sink.stream)
        for file, _ in self.logs.values():
            flush(file)

    def _write(self, source: _Source) -> None:
        self.consoles[source.err].write(source.fd, self._label(source)[1], source.pending)
        source.pending = ""

    def _log(self, rank: int, check: bool = False) -> None:
        """Open ``rank{rank}.log`` once; a failure raises with ``check``, else warns."""
        if self.log_dir is None or rank in self.logs:
            return
        path = os.path.join(self.log_dir, f"rank{rank}.log")
        try:
            file = open(path, "a" if self.restart else "w", encoding="utf-8", errors="replace", newline="")  # noqa: SIM115
            if self.restart:
                file.write(f"--- restart {self.restart} (TORCHELASTIC_RESTART_COUNT={self.restart}) ---\n")
        except OSError as error:
            if check:
                raise
            warnings.warn(f"mplaunch: cannot write {path}: {error}", RuntimeWarning, stacklevel=1)
            return
        self.logs[rank] = (file, Sink(file))


def _announced(text: bytes) -> tuple[int, int | None, int]:
    """Return ``(rank, pid, node_rank)`` from a rank mark's ``rank[,pid,node_rank]``."""
    fields = [int(field) for field in text.split(b",")]
    return fields[0], fields[1] if len(fields) > 1 else None, fields[2] if len(fields) > 2 else 0


@contextlib.contextmanager
def routed(ranks: list[int | None], spec: LaunchSpec, restart: int = 0) -> Iterator[Pump | None]:
    """Yield a :class:`Pump` for the attempt if output is routed, else ``None``; close it on exit."""
    if not should_route(spec.prefix_output, spec.console_ranks, spec.log_dir):
        yield None
        return
    pump = Pump(ranks, spec.prefix_output, spec.console_ranks, spec.log_dir, restart)
    try:
        yield pump
    finally:
        pump.close()


def worker_fds(pump: Pump | None, start_method: str, nprocs: int) -> tuple[RankFds, ...] | None:
    """Return the workers' fd table: the pump's pipes, the caller's open fd 1 and 2 under forkserver, else ``None``."""
    if pump is not None:
        return tuple(pump.fds)
    if start_method != "forkserver":
        return None
    try:
        os.fstat(1), os.fstat(2)
    except OSError:
        return None
    return (RankFds(InheritedFd(1), InheritedFd(2), routed=False),) * nprocs
