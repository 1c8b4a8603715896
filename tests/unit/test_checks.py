"""The checks run before launching, without launching."""

from __future__ import annotations

import ast
import sys
import types

import pytest
import torch

from mplaunch import LaunchRefusedError, _checks, to_cpu


def test_cuda_initialised_refuses_fork_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchRefusedError, match="start_method='spawn'"):
        _checks.check_cuda_fork("fork")
    _checks.check_cuda_fork("spawn")
    _checks.check_cuda_fork("forkserver")


def test_cuda_probe_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.cuda.is_available()
    torch.cuda.device_count()
    _checks.check_cuda_fork("fork")


def test_cuda_message_helps_notebook_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(_checks, "is_interactive", lambda: True)
    with pytest.raises(LaunchRefusedError, match="restart the kernel"):
        _checks.check_cuda_fork("fork")


def test_default_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checks, "is_interactive", lambda: False)
    assert _checks.default_start_method() == "spawn"
    monkeypatch.setattr(_checks, "is_interactive", lambda: True)
    assert _checks.default_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert _checks.default_start_method() == "spawn"


def test_main_importability(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert not _checks.main_is_importable()  # python -c, the REPL
    fake.__file__ = "<stdin>"
    assert not _checks.main_is_importable()  # python - < script
    fake.__file__ = __file__
    assert _checks.main_is_importable()


def test_guard_spans_find_every_spelling() -> None:
    source = (
        'x = 1\nif __name__ == "__main__":\n    run()\nif "__main__" == __name__:\n    run()\n'
        'if __name__ == "__main__" and x:\n    run()\nif __name__ in ("__main__",):\n    run()\n'
        'if not __name__ != "__main__":\n    run()\nif x:\n    run()\n'
    )
    assert _checks._guard_spans(ast.parse(source)) == [(2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]


def test_describe_unpicklable_names_the_argument() -> None:
    import threading

    text = _checks.describe_unpicklable((1, threading.Lock()), {}, by_value=False)
    assert text.startswith("positional argument 1 (lock)")
    with open(__file__) as file:
        text = _checks.describe_unpicklable((), {"f": file}, by_value=False)
    assert text.startswith("keyword argument 'f' (TextIOWrapper)") and "open it inside" in text


def test_to_cpu_keeps_structure() -> None:
    data = {"a": [torch.ones(1)], "b": (torch.zeros(2), 3)}
    out = to_cpu(data)
    assert out["a"][0] is data["a"][0] and out["b"][1] == 3


def test_unshare_copies_only_shared_tensors() -> None:
    from mplaunch import unshare

    private = torch.zeros(3)
    shared = torch.zeros(3).share_memory_()
    module = torch.nn.Linear(2, 2)
    module.share_memory()
    weight = module.weight
    out_private, out_shared, out_module = unshare((private, shared, module))
    assert out_private is private
    assert out_shared is not shared and not out_shared.is_shared() and torch.equal(out_shared, shared)
    assert out_module is module and module.weight is weight and not module.weight.is_shared()


def _initialise_cuda_here() -> None:
    torch.cuda._lazy_init()


def test_refused_fork_says_where_cuda_was_first_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    import mplaunch

    monkeypatch.setattr(_checks, "_first_cuda_init", None)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # a CUDA build's successful initialisation
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", torch.cuda._lazy_init)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(LaunchRefusedError, match="call mplaunch.record_cuda_init"):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        _checks.check_cuda_fork("fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    mplaunch.record_cuda_init()
    mplaunch.record_cuda_init()  # twice is once
    _initialise_cuda_here()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchRefusedError) as caught:
        _checks.check_cuda_fork("fork")
    assert "CUDA was first initialised here" in str(caught.value)
    assert "in _initialise_cuda_here" in str(caught.value) and "test_checks.py" in str(caught.value)


def test_recorder_ignores_failed_initialisation(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(_checks, "_first_cuda_init", None)
    monkeypatch.setattr(torch.cuda, "_lazy_init", fail)
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", fail)
    _checks.record_cuda_init()
    with pytest.raises(AssertionError):
        torch.cuda._lazy_init()
    assert _checks._first_cuda_init is None
