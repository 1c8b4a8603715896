"""The exception tree: builtin bases, pickling, signal names."""

from __future__ import annotations

import pickle
import signal

import pytest

from mplaunch import (
    InvalidOptionError,
    LaunchRefusedError,
    LaunchTimeoutError,
    MplaunchError,
    PreemptedError,
    RemoteError,
    RemoteTraceback,
    WorkerExitedError,
)
from mplaunch._errors import signal_name

EXAMPLES = [
    InvalidOptionError("bad"),
    LaunchRefusedError("refused"),
    WorkerExitedError("died", 1, 123, -signal.SIGKILL),
    RemoteError("remote", 0, 5, "mod.Err"),
    LaunchTimeoutError("late", 2.5, (0, 1)),
    PreemptedError("preempted", signal.SIGTERM, {0: 1}, (1,)),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_exception_pickles_with_its_attributes(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
    assert isinstance(copy, MplaunchError)


def test_builtin_bases() -> None:
    assert issubclass(InvalidOptionError, ValueError)
    assert issubclass(LaunchRefusedError, RuntimeError)
    assert issubclass(WorkerExitedError, RuntimeError)
    assert issubclass(LaunchTimeoutError, TimeoutError)
    assert str(RemoteTraceback("tb text")) == "tb text"


def test_signal_names() -> None:
    assert WorkerExitedError("x", 0, 1, -9).signal_name == "SIGKILL"
    assert signal_name(-15) == "SIGTERM"
    assert signal_name(1) is None
    assert signal_name(None) is None
    assert signal_name(0) is None
