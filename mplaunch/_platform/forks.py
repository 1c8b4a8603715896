"""What a forked child must redo first, in one ``os.register_at_fork`` hook for all of mplaunch: every child
runs it (DataLoader workers too), and a hook per module cost each some 60 page copies. Locks are renewed with
``_at_fork_reinit`` (as :mod:`logging` does); callbacks are for what must be let go at once (a descriptor
whose last copy closing tells another process this one is gone). State needed only to launch is made anew
by its owner on first use in another pid."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

_LOCKS: list[Any] = []
_CALLBACKS: list[Callable[[], None]] = []


def new_lock() -> threading.Lock:
    """Return a new ``threading.Lock`` that every forked child gets unlocked."""
    lock = threading.Lock()
    _LOCKS.append(lock)
    return lock


def in_child(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` first thing in every forked child (after the locks); a decorator."""
    _CALLBACKS.append(callback)
    return callback


def check_owner(owner: int, what: str, advice: str) -> None:
    """Raise ``RuntimeError`` unless this process is ``owner``: ``what`` is then a forked child's copy."""
    if os.getpid() != owner:
        raise RuntimeError(
            f"{what} belong to process {owner}; this process ({os.getpid()}) was forked from it and has only a "
            f"copy. {advice}"
        )


def _after_fork_in_child() -> None:
    for lock in _LOCKS:
        lock._at_fork_reinit()
    for callback in _CALLBACKS:
        callback()


os.register_at_fork(after_in_child=_after_fork_in_child)
