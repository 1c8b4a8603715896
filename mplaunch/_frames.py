"""Find the first frame outside mplaunch (by its globals' ``__name__``: survives file moves), and find an object
by module and qualified name."""

from __future__ import annotations

import contextlib
import pkgutil
import sys
import threading
import warnings
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

PACKAGE = __name__.partition(".")[0]


def is_ours(frame: FrameType) -> bool:
    """Return whether ``frame`` runs code of a module of this package."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == PACKAGE or name.startswith(PACKAGE + "."))


Caller = tuple[str, int, dict[str, Any]]  # a frame's file, line and module globals
_thread = threading.local()  # in a thread that runs a launch for its caller: ``caller``, where it was asked


def _outside(frame: FrameType | None) -> FrameType | None:
    """Return ``frame`` or the first frame it was called from that is not ours; ``None`` if all are."""
    while frame is not None and is_ours(frame):
        frame = frame.f_back
    return frame


def user_frame() -> FrameType:
    """Return the first frame outside mplaunch above this function's caller, else the caller's caller."""
    frame = sys._getframe(2)
    return _outside(frame) or frame


def outside_caller() -> Caller | None:
    """Return the file, line and module globals of the first frame outside mplaunch that called this."""
    frame = _outside(sys._getframe(1))
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


@contextlib.contextmanager
def warnings_for(caller: Caller | None) -> Iterator[None]:
    """Point warnings that would point into this thread's start at ``caller`` (a submitted launch's line)."""
    _thread.caller = caller
    try:
        yield
    finally:
        _thread.caller = None


def warn_at_user(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside mplaunch, or at the line that submitted this thread's launch."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # as seen by warnings.warn: 1 is this function, 2 its caller
    while frame is not None and is_ours(frame):
        frame, level = frame.f_back, level + 1
    caller: Caller | None = getattr(_thread, "caller", None)
    if caller is not None and (frame is None or frame.f_globals.get("__name__") == "threading"):
        filename, lineno, module_globals = caller
        registry = module_globals.setdefault("__warningregistry__", {})
        module = module_globals.get("__name__")
        # (not module_globals: warnings would ask the module's loader for its source here, in this thread)
        warnings.warn_explicit(message, category, filename, lineno, module, registry)
        return
    warnings.warn(message, category, stacklevel=level)


def without_our_frames(tb: TracebackType | None) -> TracebackType | None:
    """Return ``tb`` from its first entry outside mplaunch on; the last entry stays, so our own raise shows."""
    while tb is not None and tb.tb_next is not None and is_ours(tb.tb_frame):
        tb = tb.tb_next
    return tb


def resolve(module: str, qualname: str) -> Any:
    """Return what ``module:qualname`` names, or ``None``; only an already imported module is looked in."""
    if module not in sys.modules or not qualname:
        return None
    try:
        return pkgutil.resolve_name(f"{module}:{qualname}")
    except (AttributeError, ImportError, ValueError):
        return None


def named_original(function: Any) -> Any:
    """Return the decorated function that a copy's name finds (``fn.options()``) if it wraps the same function."""
    found = resolve(str(getattr(function, "__module__", "")), str(getattr(function, "__qualname__", "")))
    plain = getattr(function, "__wrapped__", None)
    if found is function or plain is None or getattr(found, "__wrapped__", None) is not plain:
        return None
    # another wrapper of the same function (functools.wraps) is not a decorated one
    return found if hasattr(found, "_mplaunch_target") else None
