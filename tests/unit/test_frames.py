"""The first frame outside mplaunch, told by module name; typed access to a re-raised failure."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

import mplaunch
from mplaunch import FailureInfo, LaunchOptions, ParallelConfig, failure_info
from mplaunch._frames import is_ours, resolve, without_our_frames


def _run_as(module_name: str, source: str) -> types.ModuleType:
    """Run ``source`` as a module named ``module_name`` (as mplaunch's own or a user's)."""
    module = types.ModuleType(module_name)
    exec(compile(source, f"/somewhere/{module_name.replace('.', '/')}.py", "exec"), module.__dict__)
    return module


def test_a_frame_is_ours_by_its_module_name_wherever_the_file_is() -> None:
    ours = _run_as("mplaunch._parent.deep.nested", "import sys\ndef here(): return sys._getframe()")
    theirs = _run_as("mplaunch_extras", "import sys\ndef here(): return sys._getframe()")
    assert is_ours(ours.here())
    assert not is_ours(theirs.here())  # a package whose name only starts like ours
    assert not is_ours(sys._getframe())


def test_a_warning_from_any_depth_of_the_package_points_at_the_users_line() -> None:
    inner = _run_as(
        "mplaunch._state.deeper.inner",
        "from mplaunch._frames import warn_at_user\ndef warn(): warn_at_user('careful', RuntimeWarning)",
    )
    outer = _run_as("mplaunch._parent.outer", "def call(inner): inner.warn()")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        outer.call(inner)
    assert len(caught) == 1
    assert caught[0].filename == __file__
    assert caught[0].lineno == line


def test_a_traceback_starts_at_the_users_frame() -> None:
    user = _run_as("users_code", "def fail(): raise ValueError('x')")
    runner = _run_as(
        "mplaunch._worker.runner", "def run(f):\n    try:\n        f()\n    except ValueError as e:\n        return e"
    )
    error = runner.run(user.fail)
    assert error is not None
    tb = without_our_frames(error.__traceback__)
    assert tb is not None
    assert tb.tb_frame.f_globals["__name__"] == "users_code"
    only_ours = _run_as(
        "mplaunch._x", "def fail():\n    try:\n        raise KeyError(1)\n    except KeyError as e:\n        return e"
    )
    kept = without_our_frames(only_ours.fail().__traceback__)
    assert kept is not None  # an error of mplaunch's own keeps the line that raised it


def test_resolve_finds_loaded_objects_and_imports_nothing() -> None:
    assert resolve("mplaunch._frames", "resolve") is resolve
    assert resolve("mplaunch._errors", "FailureInfo.__init__") is FailureInfo.__init__
    assert resolve("mplaunch._frames", "missing") is None
    assert resolve("a_module_that_is_not_imported", "x") is None
    assert "a_module_that_is_not_imported" not in sys.modules


def test_failure_info_reads_a_re_raised_failure_typed() -> None:
    error = ValueError("bad")
    assert failure_info(error) is None
    peer = RuntimeError("peer")
    error.rank, error.pid, error.failures, error.earlier_attempts = 1, 42, (peer,), ()  # type: ignore[attr-defined]
    assert failure_info(error) == FailureInfo(rank=1, pid=42, failures=(peer,), earlier_attempts=())
    exited = mplaunch.WorkerExitedError("rank 0 died", 0, None, -9)
    info = failure_info(exited)
    assert info is not None
    assert info.rank == 0
    assert info.pid is None


def test_launch_options_lists_every_option_but_return_all() -> None:
    fields = {field for field in ParallelConfig.__dataclass_fields__}
    assert set(LaunchOptions.__annotations__) == fields - {"return_all"}


def test_options_refuses_return_all_and_unknown_names() -> None:
    fn = mplaunch.parallel(nprocs=1)(print)
    with pytest.raises(TypeError, match="return_all"):
        fn.options(return_all=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nproc"):
        fn.options(nproc=2)  # type: ignore[call-arg]
