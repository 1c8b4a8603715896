"""The C functions under :mod:`signal`: ``signal.signal`` and ``getsignal`` try an enum for every handler
they return (a launch sets and reads some fifty). These return ``SIG_DFL``/``SIG_IGN`` as plain integers
(equal to ``signal``'s, not the same objects) and a function as itself."""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
from collections.abc import Callable, Iterable
from typing import Any

SIG_DFL: int = _signal.SIG_DFL
SIG_IGN: int = _signal.SIG_IGN
getsignal: Callable[[int], Any] = _signal.getsignal
set_handler: Callable[[int, Any], Any] = _signal.signal
pthread_sigmask: Callable[[int, Iterable[int]], set[int]] = _signal.pthread_sigmask
