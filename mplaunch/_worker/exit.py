"""What a normal interpreter exit does for a worker's data, done before the worker's ``os._exit``.

A worker ends with ``os._exit`` so that threads the function left running cannot keep it (and the call)
alive; that skips what a normal exit does: ``logging.shutdown`` (an ``atexit`` handler the worker does not
have under ``fork``/``forkserver``), and closing open file objects, which writes out what they still buffer.
"""

from __future__ import annotations

import _io
import dataclasses
import gc
import io
import sys
from typing import Any

_IN_MEMORY = (io.BytesIO, io.StringIO)
_ORDER: dict[type, int] = {io.TextIOWrapper: 1, io.BufferedWriter: 2, io.BufferedRandom: 2, io.BufferedRWPair: 2}


_inherited_handlers: list[Any] = []  # in a forked worker: logging's references to the handlers it inherited
_inherited_buffering: list[Any] = []  # those of them that buffer records
_SERVER_FILES: list[Any] = []  # the fork server's open files: its workers inherit them, frozen, and close them


def freeze_fork_server() -> None:
    """In the fork server, once its modules are imported: note its open files, then freeze every object.

    Its workers then walk only the objects they create (a walk over the ~170k objects of an imported torch
    would cost tens of milliseconds per worker and copy the server's memory pages), plus the noted files.
    """
    _SERVER_FILES[:] = _open_files(gc.get_objects())
    gc.freeze()


@dataclasses.dataclass(frozen=True)
class InheritedLogging:
    """logging's handlers as a forked worker inherits them, noted by the parent just before the fork (so the
    worker does not copy logging's list itself): ``references``, logging's weak references to every handler
    (what ``logging.shutdown`` walks), and ``buffering``, those that buffer records (``MemoryHandler``...)."""

    references: list[Any]
    buffering: list[Any]


def inherited_logging() -> InheritedLogging:
    """Logging's handlers now (see :class:`InheritedLogging`): in the parent, right before it forks a rank.
    The same record as last time while logging's list holds the same references (comparing writes nothing)."""
    global _last_logging
    found = getattr(sys.modules.get("logging"), "_handlerList", [])  # what logging.shutdown walks
    if _last_logging is not None and _last_logging.references == found:
        return _last_logging
    references = list(found)
    handlers = sys.modules.get("logging.handlers")  # not imported: no buffering handler exists
    buffering = []
    if handlers is not None:
        buffering = [h for r in references if isinstance(h := r(), handlers.BufferingHandler)]
    _last_logging = InheritedLogging(references, buffering)
    return _last_logging


_last_logging: InheritedLogging | None = None


def keep_inherited(logged: InheritedLogging | None = None) -> None:
    """Mark every object that exists now as inherited (``gc.freeze``): :func:`close_files` will leave it alone.

    Called first thing in a forked worker: the file objects and logging handlers it inherits are the
    parent's, and closing them would write what the parent still buffers a second time (a file's buffer, a
    ``MemoryHandler``'s records). It also keeps the worker's garbage collector off the parent's objects, so
    their memory pages stay shared (the ``gc.freeze`` use the Python docs give). ``logged``: logging's
    handlers as the parent noted them before the fork, else read here.
    """
    global _inherited_handlers, _inherited_buffering
    gc.freeze()
    logged = logged or inherited_logging()
    _inherited_handlers = logged.references  # held: a reference freed later cannot pass its id to a new one
    _inherited_buffering = logged.buffering
    for handler in logged.buffering:
        handler.buffer = []  # the parent's records: never written here (the parent flushes them)


def close_files() -> None:
    """Run ``logging.shutdown`` for the handlers this process created, and flush and close every open,
    writable file object it created (not the standard streams, not in-memory buffers), wrappers before what
    they wrap."""
    logging = sys.modules.get("logging")
    if logging is not None:
        try:
            _flush_own_records()
            if own := _own_handlers(logging._handlerList):
                logging.shutdown(own)
        except Exception:  # noqa: BLE001 - a broken handler must not stop the rest
            pass
    for item in sorted(_open_files(gc.get_objects()) + _SERVER_FILES, key=_layer):
        try:
            if not item.closed and item.writable():
                item.close()
        except Exception:  # noqa: BLE001 - as at interpreter exit, a file that fails to close is skipped
            pass


def _own_handlers(references: list[Any]) -> list[Any]:
    """The references to logging handlers that this process made, not inherited at fork (all of them when
    nothing was inherited)."""
    if references == _inherited_handlers:  # none made (comparing writes no memory: a forked worker's is shared)
        return []
    inherited = {id(reference) for reference in _inherited_handlers}
    return [reference for reference in references if id(reference) not in inherited]


def _flush_own_records() -> None:
    """Flush the buffering handlers (``MemoryHandler``...) inherited at fork: they hold only the records this
    process logged (the parent's were dropped when it started, see :func:`keep_inherited`)."""
    for handler in _inherited_buffering:
        handler.flush()


def _open_files(objects: list[Any]) -> list[Any]:
    """The file objects among ``objects``, except the standard streams and in-memory buffers."""
    standard = {id(stream) for stream in _standard_streams()}
    return [  # type(), not isinstance(): no __class__ property of some proxy object runs here
        item
        for item in objects
        if issubclass(type(item), _io._IOBase) and type(item) not in _IN_MEMORY and id(item) not in standard
    ]


def _layer(item: Any) -> int:
    """Closing order: wrappers written in Python (e.g. ``GzipFile``) first, then text, buffered, raw files."""
    kind = type(item)
    return 3 if issubclass(kind, _io._RawIOBase) else _ORDER.get(kind, 0)


def _standard_streams() -> list[Any]:
    streams: list[Any] = []
    for name in ("stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__"):
        stream = getattr(sys, name, None)
        while stream is not None and not any(stream is seen for seen in streams):  # some .buffer is the stream
            streams.append(stream)
            stream = getattr(stream, "buffer", None) or getattr(stream, "raw", None)
    return streams
