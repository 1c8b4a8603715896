"""The decorator and its options, without launching anything."""

from __future__ import annotations

import inspect
import multiprocessing
import pickle

import pytest

import mplaunch
from mplaunch import InvalidOptionError, ParallelFunction, parallel


@parallel
def bare(x: int, y: str = "a") -> str:
    """Bare docstring."""
    return f"{x}{y}"


@parallel(nprocs=2, start_method="fork", return_all=True, timeout=10, grace_period=1)
def with_options(x: int) -> int:
    return x


def test_bare_and_configured_forms_keep_the_function_identity() -> None:
    assert isinstance(bare, ParallelFunction)
    assert bare.__name__ == "bare"
    assert bare.__doc__ == "Bare docstring."
    assert bare.__qualname__ == "bare"
    assert bare.__module__ == __name__
    assert inspect.signature(bare) == inspect.signature(bare.__wrapped__)
    assert bare.__wrapped__(1, y="b") == "1b"  # the plain function runs in-process
    assert with_options.config.nprocs == 2
    assert with_options.config.return_all
    assert with_options.config.timeout == 10.0
    assert with_options.config.grace_period == 1.0


def test_pickles_by_reference() -> None:
    data = pickle.dumps(bare)
    assert b"bare" in data
    assert len(data) < 200
    assert pickle.loads(data) is bare


def test_unfindable_function_pickles_by_value_of_its_parts() -> None:
    def local(x: int) -> int:
        return x

    wrapped = parallel(nprocs=1)(local)
    import cloudpickle

    restored = pickle.loads(cloudpickle.dumps(wrapped))
    assert restored.__wrapped__(3) == 3
    assert restored.config == wrapped.config


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"nprocs": 0}, ["nprocs=0", ">= 1"]),
        ({"nprocs": 1.5}, ["nprocs=1.5"]),
        ({"nprocs": True}, ["nprocs=True"]),
        ({"nprocs": "many"}, ["nprocs='many'", "'auto'"]),
        ({"start_method": "thread"}, ["start_method='thread' is no start method", "'spawn'"]),
        ({"start_method": "Spawn"}, ["start_method='Spawn' is no start method", "'spawn'"]),
        ({"timeout": 0}, ["timeout=0", "> 0"]),
        ({"timeout": float("nan")}, ["timeout=nan"]),
        ({"grace_period": -1}, ["grace_period=-1", ">= 0"]),
        ({"return_all": 1}, ["return_all=1"]),
    ],
)
def test_bad_options_are_refused_when_decorating(options: dict[str, object], names: list[str]) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        parallel(**options)  # type: ignore[call-overload]
    assert isinstance(caught.value, ValueError)
    for name in names:
        assert name in str(caught.value)


def test_start_method_error_lists_the_available_ones() -> None:
    with pytest.raises(InvalidOptionError) as caught:
        parallel(start_method="fork-exec")  # type: ignore[call-overload]
    for method in multiprocessing.get_all_start_methods():
        assert repr(method) in str(caught.value)


def test_all_is_sorted_and_complete() -> None:
    assert mplaunch.__all__ == sorted(mplaunch.__all__)
    public = {name for name in vars(mplaunch) if not name.startswith("_")}
    assert set(mplaunch.__all__) == public
    for name in mplaunch.__all__:
        assert getattr(mplaunch, name).__doc__, f"{name} has no docstring"


def test_backend_is_validated_and_auto_resolves_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch._parent import devices
    from mplaunch._parent.policy import resolve_backend

    with pytest.raises(InvalidOptionError, match="backend='nccll'.*'gloo'"):
        parallel(backend="nccll")
    monkeypatch.setattr(devices, "device_count", lambda: 0)
    assert resolve_backend("auto", 2) == "gloo"
    monkeypatch.setattr(devices, "device_count", lambda: 2)
    assert resolve_backend("auto", 2) == "nccl"
    assert resolve_backend("auto", 3) == "gloo"
    assert resolve_backend("gloo", 2) == "gloo"
    assert resolve_backend(None, 2) is None


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"console_ranks": "0"}, "console_ranks='0'"),
        ({"console_ranks": [-1]}, "console_ranks=[-1]"),
        ({"console_ranks": 3}, "console_ranks=3"),
        ({"prefix_output": "yes"}, "prefix_output='yes'"),
        ({"log_dir": 5}, "log_dir=5"),
    ],
)
def test_output_options_are_validated(options: dict[str, object], text: str) -> None:
    with pytest.raises(InvalidOptionError, match=text.replace("[", r"\[").replace("]", r"\]")):
        parallel(**options)  # type: ignore[call-overload]
    assert parallel(console_ranks=(0, 1), log_dir="logs")(len).config.console_ranks == frozenset({0, 1})


def test_a_positional_option_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidOptionError, match=r"parallel\(2\) is not valid.*nprocs=2"):
        parallel(2)  # type: ignore[call-overload]


def test_wrong_call_arguments_fail_before_launching() -> None:
    # nprocs=2 with spawn would take seconds per launch: the error must come first, in the parent
    with pytest.raises(TypeError, match=r"bare\(\): missing a required argument: 'x'.*before launching"):
        parallel(nprocs=2, start_method="spawn")(bare.__wrapped__)()  # type: ignore[call-arg]  # on purpose
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        parallel(nprocs=2, start_method="spawn")(bare.__wrapped__)(1, z=2)  # type: ignore[call-arg]  # on purpose


def test_arguments_that_bound_once_do_not_let_other_ones_through() -> None:
    """A call's argument shape (how many positional arguments, which keywords) that bound once is not bound
    again; another shape of the same function still is, and a changed default makes it bind anew."""
    from mplaunch._parent.checks import check_arguments

    def two(a: int, b: int = 1) -> None: ...

    fn = parallel(nprocs=2, start_method="fork")(two)
    for _ in range(2):
        check_arguments(fn, (1,), {})
        check_arguments(fn, (1,), {"b": 2})
    with pytest.raises(TypeError, match="too many positional arguments"):
        check_arguments(fn, (1, 2, 3), {})
    with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
        check_arguments(fn, (1,), {"c": 2})
    two.__defaults__ = None  # b is required now: the same shape as before no longer binds
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        check_arguments(fn, (1,), {})


def test_async_functions_and_unreachable_console_ranks_are_refused() -> None:
    async def coroutine() -> None: ...

    with pytest.raises(InvalidOptionError, match="async function.*asyncio.run"):
        parallel(coroutine)
    with pytest.raises(InvalidOptionError, match=r"console_ranks=\[7\] names no rank"):
        parallel(nprocs=2, start_method="fork", console_ranks=[7])(len)([])


@pytest.mark.parametrize(
    "options",
    [
        {"nprocs": 0},
        {"start_method": "thread"},
        {"timeout": -1},
        {"grace_period": -1},
        {"console_ranks": "0"},
        {"max_restarts": -1},
        {"max_restarts": True},
        {"max_restarts": 1.5},
        {"backend": "nccll"},
    ],
)
def test_options_are_validated_like_the_decorator_and_leave_the_function_unchanged(options: dict[str, object]) -> None:
    with pytest.raises(InvalidOptionError) as when_decorating:
        parallel(**options)  # type: ignore[call-overload]
    config = with_options.config
    with pytest.raises(InvalidOptionError) as with_options_call:
        with_options.options(**options)  # type: ignore[arg-type]
    assert str(with_options_call.value) == str(when_decorating.value)
    assert with_options.config is config


def test_options_merge_into_a_new_function() -> None:
    changed = with_options.options(nprocs=1, timeout=None, max_restarts=2, console_ranks=[0])
    assert changed is not with_options
    assert isinstance(changed, ParallelFunction)
    assert (changed.config.nprocs, changed.config.timeout, changed.config.max_restarts) == (1, None, 2)
    assert changed.config.console_ranks == frozenset({0})
    assert changed.config.return_all
    assert changed.config.grace_period == 1.0  # kept
    assert (with_options.config.nprocs, with_options.config.timeout, with_options.config.max_restarts) == (2, 10, 0)
    assert changed.__name__ == "with_options"
    assert changed.__wrapped__ is with_options.__wrapped__
    assert with_options.options() is not with_options
    assert with_options.options().config == with_options.config
    with pytest.raises(TypeError):
        with_options.options(nproc=2)  # type: ignore[call-arg]


def test_max_restarts_error_says_what_it_counts() -> None:
    with pytest.raises(InvalidOptionError, match=r"max_restarts=-1 is not valid: .*restarts after a worker failure"):
        parallel(max_restarts=-1)


@pytest.mark.parametrize(
    ("options", "name"), [({"log_dir": ""}, "log_dir"), ({"nnodes": 2, "node_rank": 5}, "node_rank")]
)
def test_values_that_cannot_work_are_refused_when_decorating(options: dict[str, object], name: str) -> None:
    """An empty log_dir wrote rank0.log into the working directory; node_rank >= nnodes ended in a rendezvous
    timeout at call time."""
    with pytest.raises(InvalidOptionError, match=name):
        parallel(**options)  # type: ignore[call-overload]
