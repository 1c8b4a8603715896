"""What a normal exit does for a worker's data, done before its ``os._exit`` (so that threads the function left
cannot keep it alive): ``logging.shutdown``, and closing open files, which writes out their buffers."""

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
_last_logging: InheritedLogging | None = None


def freeze_fork_server() -> None:
    """Note the fork server's open files, then freeze every object (speed: its workers then walk only their own)."""
    _SERVER_FILES[:] = _open_files(gc.get_objects())
    gc.freeze()


@dataclasses.dataclass(frozen=True)
class InheritedLogging:
    """logging's handler references (what ``logging.shutdown`` walks) and its buffering handlers, at fork."""

    references: list[Any]
    buffering: list[Any]


def inherited_logging() -> InheritedLogging:
    """Return logging's handlers now; the last record while the list is unchanged (comparing writes nothing)."""
    global _last_logging
    found = getattr(sys.modules.get("logging"), "_handlerList", [])  # what logging.shutdown walks
    if _last_logging is not None and _last_logging.references == found:
        return _last_logging
    references = list(found)
    handlers = sys.modules.get("logging.handlers")  # not imported: no buffering handler exists
    buffering = [] if handlers is None else [h for r in references if isinstance(h := r(), handlers.BufferingHandler)]
    _last_logging = InheritedLogging(references, buffering)
    return _last_logging


def keep_inherited(logged: InheritedLogging | None = None) -> None:
    """Freeze every object (the collector keeps off the parent's pages, :func:`close_files` off its buffers)."""
    global _inherited_handlers, _inherited_buffering
    gc.freeze()
    logged = logged or inherited_logging()
    _inherited_handlers = logged.references  # held: a reference freed later cannot pass its id to a new one
    _inherited_buffering = logged.buffering
    for handler in logged.buffering:
        handler.buffer = []  # the parent's records: never written here (the parent flushes them)


def close_files() -> None:
    """Shut down this process's own logging handlers, then close its writable files, wrappers first."""
    logging = sys.modules.get("logging")
    if logging is not None:
        try:
            for handler in _inherited_buffering:  # inherited, but holding only this process's records
                handler.flush()
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
    """Return the handler references this process made, not inherited at fork."""
    if references == _inherited_handlers:  # none made (comparing writes no memory: a forked worker's is shared)
        return []
    inherited = {id(reference) for reference in _inherited_handlers}
    return [reference for reference in references if id(reference) not in inherited]


def _open_files(objects: list[Any]) -> list[Any]:
    """Return the file objects among ``objects``, except the standard streams and in-memory buffers."""
    standard = {id(stream) for stream in _standard_streams()}
    return [  # type(), not isinstance(): no __class__ property of some proxy object runs here
        item
        for item in objects
        if issubclass(type(item), _io._IOBase) and type(item) not in _IN_MEMORY and id(item) not in standard
    ]


def _layer(item: Any) -> int:
    """Return the closing order: Python wrappers (``GzipFile``) first, then text, buffered, raw files."""
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
