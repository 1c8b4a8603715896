"""The first frame outside mplaunch: where a warning points (the user's line) and where a worker's traceback
starts (the user's function); and finding an object by module and qualified name.

A frame is mplaunch's when the module that runs it is ``mplaunch`` or one of its submodules, as its globals'
``__name__`` says. Module names do not change when files move, and a user's file that happens to sit next
to mplaunch's is not mistaken for it.
"""

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
    """Whether ``frame`` runs code of a module of this package."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == PACKAGE or name.startswith(PACKAGE + "."))


Caller = tuple[str, int, dict[str, Any]]  # a frame's file, line and module globals
_thread = threading.local()  # in a thread that runs a launch for its caller: ``caller``, where it was asked


def _outside(frame: FrameType | None) -> FrameType | None:
    """``frame``, or the first frame it was called from that is not mplaunch's; ``None`` if all are."""
    while frame is not None and is_ours(frame):
        frame = frame.f_back
    return frame


def user_frame() -> FrameType:
    """The first frame outside mplaunch that called this function's caller (the user's line, also through
    a wrapper of mplaunch's: a bound decorated method); the caller's own caller if every frame is ours."""
    frame = sys._getframe(2)
    return _outside(frame) or frame


def outside_caller() -> Caller | None:
    """Where the first frame outside mplaunch that called this is: its file, line and module globals."""
    frame = _outside(sys._getframe(1))
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


@contextlib.contextmanager
def warnings_for(caller: Caller | None) -> Iterator[None]:
    """In a thread that runs a launch for someone else (a submitted launch's thread): warnings that would
    point into the thread's start point at ``caller`` (the line that submitted the launch) instead."""
    _thread.caller = caller
    try:
        yield
    finally:
        _thread.caller = None


def warn_at_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside mplaunch that called this;
    in a submitted launch's thread, to the line that submitted it (see :func:`warnings_for`)."""
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
    """``tb`` from its first entry outside mplaunch on (the entries above it, mplaunch's own frames that
    called the user's code, tell the user nothing); the last entry is kept even when it is ours, so an error
    raised by mplaunch itself keeps the line that raised it."""
    while tb is not None and tb.tb_next is not None and is_ours(tb.tb_frame):
        tb = tb.tb_next
    return tb


def resolve(module: str, qualname: str) -> Any:
    """The object that ``module``'s ``qualname`` names (``pkgutil.resolve_name``), or ``None``; only a module
    that is already imported is looked in (nothing is imported to decide)."""
    if module not in sys.modules or not qualname:
        return None
    try:
        return pkgutil.resolve_name(f"{module}:{qualname}")
    except (AttributeError, ImportError, ValueError):
        return None


def named_original(function: Any) -> Any:
    """For a decorated function that its name does not find (a copy made by ``fn.options(...)``), the decorated
    function its name finds, when both run the same plain function; else ``None``."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    found = resolve(module, qualname)
    plain = getattr(function, "__wrapped__", None)
    if found is None or found is function or plain is None or getattr(found, "__wrapped__", None) is not plain:
        return None
    if not hasattr(found, "_mplaunch_target"):
        return None  # another wrapper of the same function (functools.wraps), not a decorated one
    return found
