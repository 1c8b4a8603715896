"""Checked by mypy (tests/unit/test_typing.py), never run: the decorated function keeps its signature."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from mplaunch import parallel


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
