"""Sharing the user asked for is kept (issue 21, item 8): pytorch/examples mnist_hogwild's shape, a model
shared with ``share_memory()`` in the parent and updated in place by every rank, under every start method;
a model that is not shared stays the parent's own, as do tensors shared only by mplaunch's transport
(tests/integration/test_state.py)."""

from __future__ import annotations

import pytest
import torch

import mplaunch
from mplaunch import StartMethod
from tests import compat_workers

METHODS = ["fork", "spawn", "forkserver"]


@pytest.mark.parametrize("start_method", METHODS)
def test_a_shared_model_is_updated_by_every_rank(start_method: StartMethod) -> None:
    model = torch.nn.Linear(3, 2)
    model.share_memory()
    turn = torch.zeros(1).share_memory_()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    shared = mplaunch.spawn(
        compat_workers.hogwild_train, args=(model, turn), nprocs=2, start_method=start_method, timeout=60
    )
    assert shared is True and turn.item() == 2
    for parameter, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(parameter.detach(), old + 2)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_model_not_shared_stays_the_parents(start_method: StartMethod) -> None:
    model = torch.nn.Linear(3, 2)
    turn = torch.zeros(1).share_memory_()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    shared = mplaunch.spawn(
        compat_workers.hogwild_train, args=(model, turn), nprocs=2, start_method=start_method, timeout=60
    )
    assert shared is False and turn.item() == 2
    for parameter, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter.detach(), old)
