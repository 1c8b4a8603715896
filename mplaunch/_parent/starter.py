"""Warm workers are started from one long-lived thread of the parent.

A worker's ``PR_SET_PDEATHSIG`` fires when the *thread* that forked it ends, not the process: warm workers
outlive the call that started them, so they must not be started from a thread that ends before them (a
``submit()``'s, or a thread of the user's). Every start of warm workers runs in this module's thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]] = queue.SimpleQueue()
_starter: threading.Thread | None = None
_starter_lock = threading.Lock()


def _forget_starter() -> None:
    """In a forked child (a rank of fork-started warm workers runs in the thread that forked it, the
    starter): no thread serves the jobs there, so the child starts a starter of its own when it needs one."""
    global _jobs, _starter
    _jobs, _starter = queue.SimpleQueue(), None
    _starter_lock._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget_starter)


def in_starter(job: Callable[[], T]) -> T:
    """Run ``job`` (which starts processes) in one long-lived thread and return its value or raise its error.

    A worker's ``PR_SET_PDEATHSIG`` fires when the *thread* that forked it ends, so warm workers must not be
    started from a thread that ends before them (a ``submit()``'s)."""
    global _starter
    with _starter_lock:
        if _starter is None or not _starter.is_alive():
            _starter = threading.Thread(target=_serve_jobs, name="mplaunch-starter", daemon=True)
            _starter.start()
    answer: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    _jobs.put((job, answer))
    try:
        ok, value = answer.get()
    except KeyboardInterrupt:  # the start goes on in the starter: wait for it, so it can be undone
        ok, value = answer.get()
        raise
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _serve_jobs() -> None:
    while True:
        job, answer = _jobs.get()
        try:
            answer.put((True, job()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            answer.put((False, error))
        del job, answer
