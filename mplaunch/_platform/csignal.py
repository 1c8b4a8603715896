"""The C functions under :mod:`signal`, for code that calls them on every launch.

``signal.signal`` and ``signal.getsignal`` turn each handler they return into an enum, trying
``Handlers(handler)`` and catching the ValueError for every Python function; a launch sets and reads some
fifty handlers. These return what was set: ``SIG_DFL`` and ``SIG_IGN`` as the plain integers below (equal to
``signal.SIG_DFL``/``signal.SIG_IGN``, not the same objects), a function as itself.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
from collections.abc import Callable, Iterable
from typing import Any

SIG_DFL: int = _signal.SIG_DFL
SIG_IGN: int = _signal.SIG_IGN
getsignal: Callable[[int], Any] = _signal.getsignal
set_handler: Callable[[int, Any], Any] = _signal.signal
pthread_sigmask: Callable[[int, Iterable[int]], set[int]] = _signal.pthread_sigmask
