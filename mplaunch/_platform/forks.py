"""What a process forked from this one must redo first, for all of mplaunch in one ``os.register_at_fork`` hook.

Every child that this process forks runs it: a fork-started rank, and also the user's own (a DataLoader
worker, a ``multiprocessing.Pool`` worker). One hook that touches little is cheap there; one hook per module,
each a Python function with its own module to look into, cost each child some 60 page copies (issue 26).
State that a child only needs when it launches (the device pool, the starter thread) is not reset here:
its owner notes the pid that made it and makes it anew on first use in another process.

Locks a thread of the parent may hold at the fork are made new with CPython's own ``_at_fork_reinit`` (as
:mod:`logging` does). Callbacks are for what must be let go at once: a descriptor whose last copy ending
tells another process that this one is gone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

_LOCKS: list[Any] = []
_CALLBACKS: list[Callable[[], None]] = []


def new_lock() -> threading.Lock:
    """Return a new ``threading.Lock`` that every child forked from this process gets unlocked."""
    lock = threading.Lock()
    _LOCKS.append(lock)
    return lock


def in_child(callback: Callable[[], None]) -> Callable[[], None]:
    """Have ``callback`` run first thing in every child forked from this process (after the locks are new);
    returns it, so that it serves as a decorator."""
    _CALLBACKS.append(callback)
    return callback


def check_owner(owner: int, what: str, advice: str) -> None:
    """Raise ``RuntimeError`` unless this process is ``owner`` (a pid): ``what`` (e.g. ``"these
    mplaunch.Workers"``) is then a copy that a child forked from the owner inherited, whose use would act on
    the owner's workers; ``advice`` says what to do instead."""
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
