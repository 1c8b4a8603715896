"""Checked by mypy (tests/unit/test_typing.py), never run: the decorated function keeps its signature."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import torch
from typing_extensions import assert_type

from mplaunch import LaunchFuture, LaunchOptions, failure_info, parallel


@parallel
def bare(x: int, y: str = "a") -> float:
    return 1.0


@parallel(nprocs=2, start_method="spawn")
def configured(lr: float, epochs: int = 3) -> dict[str, torch.Tensor]:
    return {}


@parallel(nprocs=2, return_all=True)
def every_rank(x: int) -> int:
    return x


assert_type(bare(1, y="b"), float)
assert_type(configured(0.1, epochs=5), dict[str, torch.Tensor])
assert_type(every_rank(1), list[int])
bare("not an int")  # type: ignore[arg-type]
configured(0.1, epoch=5)  # type: ignore[call-arg]
every_rank("x")  # type: ignore[arg-type]

# submit() keeps the parameters and returns a Future of the call's result; options() keeps the function's type.
assert_type(bare.submit(1, y="b"), LaunchFuture[float])
assert_type(every_rank.submit(1), LaunchFuture[list[int]])
plain: Future[float] = bare.submit(1)  # a concurrent.futures.Future, with preempt()
assert_type(bare.submit(1).preempt(), bool)
assert_type(configured.options(nprocs=1, timeout=60.0)(0.1, epochs=5), dict[str, torch.Tensor])
assert_type(configured.options(max_restarts=2).submit(0.1).result(), dict[str, torch.Tensor])
assert_type(asyncio.wrap_future(bare.submit(1)), asyncio.Future[float])
bare.submit("not an int")  # type: ignore[arg-type]
configured.submit(0.1, epoch=5)  # type: ignore[call-arg]
configured.options(nproc=1)  # type: ignore[call-arg]
configured.options(nprocs="all")  # type: ignore[arg-type]
configured.options(nprocs=1)(0.1, epoch=5)  # type: ignore[call-arg]
assert_type(every_rank.options(nprocs=4)(1), list[int])
every_rank.options(nprocs=4)("x")  # type: ignore[arg-type]

# The options are one TypedDict: a user's wrapper can forward them typed; a failure's rank reads typed.
options: LaunchOptions = {"nprocs": 2, "timeout": 30.0}
assert_type(configured.options(**options)(0.1), dict[str, torch.Tensor])
bad_options: LaunchOptions = {"nprocs": "all"}  # type: ignore[typeddict-item]
info = failure_info(ValueError("x"))
if info is not None:
    assert_type(info.rank, int)
    assert_type(info.pid, int | None)
    assert_type(info.failures, tuple[BaseException, ...])
