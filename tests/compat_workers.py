"""Module-level worker functions for the exit-order and compatibility tests (importable by spawn/forkserver
workers)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
from typing import Any

import torch


def _tracker_helper(connection: Any, path: str) -> None:
    """A tracker's helper process: on the rank's last message, write it to ``path`` and acknowledge."""
    message = connection.recv()
    with open(path, "w") as file:
        file.write(message)
    connection.send("saved")


def _finish_run(connection: Any) -> None:
    connection.send("final metrics")
    connection.recv()  # as a tracker's finish() waits for its helper


def tracker_at_exit(path: str) -> int:
    """Start a helper process and register an ``atexit`` handler that finishes the run through it."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    helper = multiprocessing.get_context("fork").Process(target=_tracker_helper, args=(theirs, path), daemon=True)
    helper.start()
    atexit.register(_finish_run, ours)
    return 7


def _exit(code: int) -> None:
    raise SystemExit(code)


class ExitsWhenPickled:
    """A result whose pickling raises ``SystemExit(3)``."""

    def __reduce__(self) -> Any:
        raise SystemExit(3)


class ExitsWhenUnpickled:
    """A result whose unpickling (in the parent) raises ``SystemExit(4)``."""

    def __reduce__(self) -> Any:
        return (_exit, (4,))


def result_exiting_when_pickled(path: str) -> Any:
    atexit.register(_write, path, "atexit ran")
    return ExitsWhenPickled()


def result_exiting_when_unpickled() -> Any:
    return ExitsWhenUnpickled()


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def add_one(module: torch.nn.Linear) -> bool:
    """The hogwild step: update the module's weight in place; returns whether it is shared here."""
    with torch.no_grad():
        module.weight.add_(1.0)
    return bool(module.weight.is_shared())


def pid() -> int:
    return os.getpid()
