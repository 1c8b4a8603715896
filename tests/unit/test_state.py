"""The global-state snapshot, in one process."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy
import pytest
import torch

from mplaunch import GlobalState, register_state, unregister_state


@pytest.fixture
def restored_state() -> Iterator[None]:
    """Put back the process's state after a test that changes it (and the variable that torch's first
    use_deterministic_algorithms() call sets when it imports inductor)."""
    state = GlobalState.capture()
    environ = dict(os.environ)
    yield
    state.restore()
    os.environ.clear()
    os.environ.update(environ)


def test_restore_brings_back_settings_and_random_streams(restored_state: None) -> None:
    random.seed(1)
    numpy.random.seed(1)
    torch.manual_seed(1)
    state = GlobalState.capture()
    expected = (random.random(), numpy.random.rand(), torch.rand(2))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.set_default_dtype(torch.float64)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.autograd.set_detect_anomaly(True)
    random.seed(2)
    numpy.random.seed(2)
    torch.manual_seed(2)
    state.restore()
    assert torch.are_deterministic_algorithms_enabled() is state.deterministic
    assert torch.get_float32_matmul_precision() == state.float32_matmul_precision
    assert torch.get_default_dtype() == state.default_dtype
    assert torch.backends.cudnn.benchmark is state.cudnn_benchmark
    assert torch.is_anomaly_enabled() is state.anomaly_enabled
    again = (random.random(), numpy.random.rand(), torch.rand(2))
    assert again[0] == expected[0] and again[1] == expected[1] and torch.equal(again[2], expected[2])


def test_restore_calls_no_setter_when_nothing_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    state = GlobalState.capture()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("setter called although the value already matched")

    for name in ("use_deterministic_algorithms", "set_float32_matmul_precision", "set_default_dtype"):
        monkeypatch.setattr(torch, name, forbidden)
    monkeypatch.setattr(torch.autograd, "set_detect_anomaly", forbidden)
    state.restore()


def test_capture_never_initialises_cuda() -> None:
    state = GlobalState.capture()
    assert state.cuda_rng is None or torch.cuda.is_initialized()
    assert not torch.cuda.is_initialized() or torch.cuda.is_available()


_custom: dict[str, int] = {"mode": 0}


def _capture_custom() -> int:
    return _custom["mode"]


def _restore_custom(value: int) -> None:
    _custom["mode"] = value


def test_registered_state_travels_with_the_snapshot() -> None:
    register_state(_capture_custom, _restore_custom)
    register_state(_capture_custom, _restore_custom)  # twice is once
    try:
        _custom["mode"] = 3
        state = GlobalState.capture()
        assert len(state.extra) == 1
        _custom["mode"] = 0
        state.restore()
        assert _custom["mode"] == 3
    finally:
        unregister_state(_capture_custom, _restore_custom)
    assert GlobalState.capture().extra == ()
