"""The records that cross the process boundary, and what the parent makes of them, in one process."""

from __future__ import annotations

import itertools
import os
import pickle
import signal

import pytest

from mplaunch import RemoteError, RemoteTraceback, WorkerExitedError
from mplaunch._parent.outcomes import Stopped, exit_error, rank_state, rebuild_exception
from mplaunch._wire.records import (
    PAYLOAD,
    REMOTE_RANK0,
    Outcome,
    Raised,
    Returned,
    Signalled,
    exit_status,
    outcome_name,
    outcome_rank,
)

PID = 4242


class ReadOnlyRank(Exception):
    """An exception whose ``rank`` cannot be set: rebuilding it must not fail."""

    @property
    def rank(self) -> int:
        return -7


class Unpicklable(Exception):
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("cannot pickle this")


class NeedsTwo(Exception):
    """Pickles, but cannot be unpickled: ``__init__`` wants two arguments and ``args`` holds one."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")


def raised(error: BaseException) -> Raised:
    """The record a worker writes for ``error``, raised (so that it has a traceback) in this process."""
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
        return Raised.of(caught)


OUTCOMES: dict[str, Outcome | None] = {
    "returned": Returned(PID, {"loss": 0.5}),
    "raised": raised(ValueError("bad value")),
    "signalled": Signalled(PID, signal.SIGTERM),
    "none": None,
}
EXIT_CODES = [0, 1, -signal.SIGKILL, 128 + signal.SIGTERM]


@pytest.mark.parametrize(("kind", "stopped", "exitcode"), list(itertools.product(OUTCOMES, [False, True], EXIT_CODES)))
def test_rank_state_of_every_outcome_stop_and_exit_code(kind: str, stopped: bool, exitcode: int) -> None:
    outcome = OUTCOMES[kind]
    state = rank_state(3, outcome, exitcode, PID + 1, stopped)
    if kind == "returned":  # a rank that returned did its work, whatever happened to it afterwards
        assert state is outcome
    elif kind == "raised":  # an exception of its own is a failure even when the stop reached it after
        assert type(state) is ValueError
        assert str(state) == "bad value"
        assert state.rank == 3  # type: ignore[attr-defined]
        assert state.pid == os.getpid()  # type: ignore[attr-defined]
    elif stopped:  # the launch ended it: never a failure
        assert state == Stopped(3)
    elif kind == "signalled":  # a SIGTERM from outside the launch
        assert isinstance(state, WorkerExitedError)
        assert (state.rank, state.pid, state.exitcode) == (3, PID, exitcode)
        assert state.signum == signal.SIGTERM
        assert state.signal_name == "SIGTERM"
        assert "SIGTERM" in str(state)
        assert "came from outside the launch" in str(state)
    else:  # it wrote no outcome: it died, or exited without returning
        assert isinstance(state, WorkerExitedError)
        assert (state.rank, state.pid, state.exitcode) == (3, PID + 1, exitcode)
        assert str(state).startswith(f"rank 3 (pid {PID + 1}) ")
        if exitcode < 0:
            assert state.signal_name == "SIGKILL"
            assert "out-of-memory" in str(state)
        else:
            assert state.signal_name is None
            assert f"exited with code {exitcode} before returning" in str(state)


def test_an_exception_is_rebuilt_as_its_own_type_with_rank_pid_note_and_remote_traceback() -> None:
    record = raised(KeyError("missing"))
    assert record.pid == os.getpid()
    assert record.type_name == "builtins.KeyError"
    assert record.exit_code is None
    error = rebuild_exception(record, 2)
    assert type(error) is KeyError
    assert error.args == ("missing",)
    assert error.rank == 2  # type: ignore[attr-defined]
    assert error.pid == os.getpid()  # type: ignore[attr-defined]
    assert error.__notes__ == [f"(raised in mplaunch worker rank 2 (pid {os.getpid()}))"]
    assert isinstance(error.__cause__, RemoteTraceback)
    remote = str(error.__cause__)
    assert f"rank 2 (pid {os.getpid()}) raised:" in remote
    assert "raise error" in remote
    assert "KeyError: 'missing'" in remote  # the worker's traceback, as text


def test_an_attribute_the_exception_refuses_does_not_stop_the_rebuild() -> None:
    error = rebuild_exception(raised(ReadOnlyRank("read-only")), 1)
    assert type(error) is ReadOnlyRank
    assert error.rank == -7
    assert error.pid == os.getpid()  # type: ignore[attr-defined]
    assert isinstance(error.__cause__, RemoteTraceback)


def test_an_mplaunch_failure_from_a_nested_launch_gets_no_note() -> None:
    inner = WorkerExitedError("rank 1 (pid 5) exited with code 3 before returning", 1, 5, 3)
    error = rebuild_exception(raised(inner), 0)
    assert type(error) is WorkerExitedError
    assert str(error) == str(inner)
    assert error.exitcode == 3
    assert (error.rank, error.pid) == (0, os.getpid())
    assert not hasattr(error, "__notes__")


@pytest.mark.parametrize(
    ("error", "why"),
    [(Unpicklable("custom failure"), "cannot be pickled"), (NeedsTwo(1, 2), "cannot be unpickled")],
    ids=["unpicklable", "not-unpicklable"],
)
def test_an_exception_that_cannot_travel_becomes_remote_error(error: Exception, why: str) -> None:
    record = raised(error)
    assert (record.exception is None) == (why == "cannot be pickled")
    rebuilt = rebuild_exception(record, 1)
    assert type(rebuilt) is RemoteError
    assert rebuilt.rank == 1
    assert rebuilt.pid == os.getpid()
    assert rebuilt.type_name == f"{__name__}.{type(error).__qualname__}"
    assert str(rebuilt).startswith(f"rank 1 (pid {os.getpid()}) raised {rebuilt.type_name}: {error}")
    assert "could not be sent as itself" in str(rebuilt)
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert f"{type(error).__name__}: {error}" in str(rebuilt.__cause__)


def test_corrupt_exception_bytes_become_remote_error() -> None:
    record = Raised(PID, b"not a pickle", "mod.Error", "what it said", "Traceback: ...")
    rebuilt = rebuild_exception(record, 0)
    assert type(rebuilt) is RemoteError
    assert rebuilt.type_name == "mod.Error"
    assert "what it said" in str(rebuilt)


@pytest.mark.parametrize(
    ("error", "code", "shown"),
    [
        (SystemExit(), 0, "SystemExit()"),
        (SystemExit(None), 0, "SystemExit(None)"),
        (SystemExit(0), 0, "SystemExit(0)"),
        (SystemExit(3), 3, "SystemExit(3)"),
        (SystemExit(True), 1, "SystemExit(True)"),
        (SystemExit("a message"), 1, "SystemExit('a message')"),
        (KeyboardInterrupt(), 128 + signal.SIGINT, "KeyboardInterrupt()"),
    ],
)
def test_system_exit_and_keyboard_interrupt_become_worker_exited_with_cpythons_exit_code(
    error: BaseException, code: int, shown: str
) -> None:
    record = raised(error)
    assert record.exit_code == code
    rebuilt = rebuild_exception(record, 1)
    assert type(rebuilt) is WorkerExitedError
    assert (rebuilt.rank, rebuilt.pid, rebuilt.exitcode, rebuilt.signal_name) == (1, os.getpid(), code, None)
    assert str(rebuilt) == (
        f"rank 1 (pid {os.getpid()}) raised {shown} before returning, so it has no result (exit code {code})"
    )
    assert isinstance(rebuilt.__cause__, RemoteTraceback)


def test_another_base_exception_is_not_raised_in_the_parent_as_itself() -> None:
    rebuilt = rebuild_exception(raised(GeneratorExit("closed")), 0)
    assert type(rebuilt) is WorkerExitedError
    assert rebuilt.exitcode == 1


@pytest.mark.parametrize(
    ("code", "status"), [(None, 0), (0, 0), (5, 5), (True, 1), (False, 0), ("message", 1), (2.5, 1), ([1], 1)]
)
def test_exit_status_is_cpythons(code: object, status: int) -> None:
    assert exit_status(code) == status


@pytest.mark.parametrize(
    ("exitcode", "signum", "message"),
    [
        (
            -signal.SIGKILL,
            None,
            "rank 1 (pid 9) was ended by SIGKILL (signal 9); the out-of-memory killer is a possible",
        ),
        (-signal.SIGSEGV, None, "rank 1 (pid 9) was ended by SIGSEGV (signal 11)"),
        (
            128 + signal.SIGTERM,
            signal.SIGTERM,
            "rank 1 (pid 9) was ended by SIGTERM (signal 15, exit code 143) that came from outside the launch",
        ),
        (None, signal.SIGINT, "rank 1 (pid 9) was ended by SIGINT (signal 2) that came from outside the launch"),
        (0, None, "rank 1 (pid 9) exited with code 0 before returning (os._exit() or sys.exit() from another thread?)"),
        (3, None, "rank 1 (pid 9) exited with code 3 before returning"),
    ],
)
def test_exit_error_names_the_signal_and_the_likely_cause(
    exitcode: int | None, signum: int | None, message: str
) -> None:
    error = exit_error(1, 9, exitcode, signum)
    assert str(error).startswith(message)
    assert ("out-of-memory" in str(error)) == (exitcode == -signal.SIGKILL)
    assert (error.rank, error.pid, error.exitcode) == (1, 9, exitcode)
    named = signum if signum is not None else (-exitcode if exitcode is not None and exitcode < 0 else None)
    assert error.signum == named
    assert error.signal_name == (signal.Signals(named).name if named is not None else None)


def test_an_unknown_signal_is_named_by_its_number() -> None:
    error = exit_error(0, 9, -99, None)
    assert error.signal_name == "signal 99"
    assert "was ended by signal 99 (signal 99)" in str(error)


@pytest.mark.parametrize("rank", [0, 1, 7, 10, 123])
def test_outcome_names_round_trip(rank: int) -> None:
    assert outcome_rank(f"{outcome_name(rank)}.pkl") == rank


@pytest.mark.parametrize(
    "filename",
    [
        "rank0",  # no extension
        "rank0.bin",  # the data file, written before the record
        ".rank0.pkl",  # the record being written (staging)
        "rank0.pkl.tmp",
        "rank.pkl",
        "rank-1.pkl",
        "rankx.pkl",
        "rank 1.pkl",
        f"{PAYLOAD}.pkl",
        f"{REMOTE_RANK0}.pkl",
        "elastic",
    ],
)
def test_other_entries_of_the_launch_directory_are_no_outcome(filename: str) -> None:
    assert outcome_rank(filename) is None


def test_a_name_with_a_superscript_digit_is_no_outcome() -> None:
    assert outcome_rank("rank\u00b2.pkl") is None


def test_records_are_frozen_and_pickle() -> None:
    record = raised(ValueError("x"))
    with pytest.raises(AttributeError):
        record.pid = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(record)) == record
    assert pickle.loads(pickle.dumps(Signalled(1, 15))) == Signalled(1, 15)
