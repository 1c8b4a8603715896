"""Warm workers are started from one long-lived thread of the parent: a worker's ``PR_SET_PDEATHSIG`` fires
when the *thread* that forked it ends, and warm workers outlive the call (a ``submit()``'s thread) that
started them."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from mplaunch._platform import forks

T = TypeVar("T")

_Jobs = queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]]
_jobs: _Jobs | None = None
_starter: threading.Thread | None = None
_owner = -1  # the pid whose starter this is: a forked child has none serving its jobs, so it starts its own
_starter_lock = forks.new_lock()


def in_starter(job: Callable[[], T]) -> T:
    """Run ``job`` (which starts processes) in the starter thread; return its value or raise its error."""
    global _jobs, _starter, _owner
    with _starter_lock:
        if _owner != os.getpid() or _jobs is None:
            _jobs, _starter, _owner = queue.SimpleQueue(), None, os.getpid()
        if _starter is None or not _starter.is_alive():
            _starter = threading.Thread(target=_serve_jobs, args=(_jobs,), name="mplaunch-starter", daemon=True)
            _starter.start()
        jobs = _jobs
    answer: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    jobs.put((job, answer))
    try:
        ok, value = answer.get()
    except KeyboardInterrupt:  # the start goes on in the starter: wait for it, so it can be undone
        ok, value = answer.get()
        raise
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _serve_jobs(jobs: _Jobs) -> None:
    while True:
        job, answer = jobs.get()
        try:
            answer.put((True, job()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            answer.put((False, error))
        del job, answer
