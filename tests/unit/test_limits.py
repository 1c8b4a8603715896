"""The limits named when workers cannot start (issue 21), without starting any."""

from __future__ import annotations

import errno

import pytest

from mplaunch import LaunchRefusedError
from mplaunch._parent import limits


def test_a_variable_too_long_for_exec_is_named() -> None:
    assert limits.environment_problem({"PATH": "/bin"}) is None
    problem = limits.environment_problem({"PATH": "/bin", "BIG": "x" * limits.MAX_ARG_STRLEN})
    assert problem is not None and "BIG" in problem and "MAX_ARG_STRLEN" in problem
    with pytest.raises(LaunchRefusedError, match="BIG.*E2BIG.*start_method='fork'"):
        limits.check_exec_environment({"BIG": "x" * 2_000_000}, "spawn")


def test_many_variables_over_arg_max_are_named() -> None:
    environ = {f"V{i}": "x" * 100_000 for i in range(200)}  # each fits, all together do not
    problem = limits.environment_problem(environ)
    assert problem is not None and "ARG_MAX" in problem


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), ["RLIMIT_NPROC", "--pids-limit", "-u"]),
        (OSError(errno.EMFILE, "Too many open files"), ["RLIMIT_NOFILE", "ulimit -n"]),
        (OSError(errno.E2BIG, "Argument list too long"), ["E2BIG", "start_method='fork'"]),
        (EOFError("unexpected EOF"), ["fork server", "RLIMIT_NPROC", "RLIMIT_NOFILE"]),
        (OSError("AF_UNIX path too long"), ["fork server's socket", "107 bytes", "set TMPDIR to a shorter"]),
    ],
)
def test_start_errors_name_the_limit_and_the_fix(error: BaseException, words: list[str]) -> None:
    refused = limits.start_refused(error, "forkserver", 1, 2)
    assert refused is not None
    assert all(word in str(refused) for word in words), str(refused)


def test_other_errors_pass_unchanged() -> None:
    assert limits.start_refused(OSError(errno.ENOENT, "No such file"), "spawn", 0, 2) is None
    assert limits.start_refused(ValueError("x"), "spawn", 0, 2) is None
