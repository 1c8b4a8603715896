"""The checks run before launching, without launching."""

from __future__ import annotations

import ast
import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from mplaunch import LaunchRefusedError
from mplaunch._parent import checks, policy
from mplaunch._wire import importable


def test_cuda_initialised_refuses_fork_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchRefusedError, match="start_method='spawn'"):
        checks.check_cuda_fork("fork")
    checks.check_cuda_fork("spawn")
    checks.check_cuda_fork("forkserver")


def test_cuda_probe_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting devices (``device_count()``) does not initialise CUDA, so fork stays allowed. On a machine without
    CUDA nothing initialises, so CUDA's initialisation is replaced by one that succeeds and is seen by the check
    (tests/gpu probes the real one; ``is_available()``, which initialises the driver: test_cuda_probes.py)."""
    initialised: list[bool] = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: initialised.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(initialised))
    torch.cuda.device_count()
    assert not initialised
    checks.check_cuda_fork("fork")
    torch.cuda.init()  # what does initialise CUDA is refused
    with pytest.raises(LaunchRefusedError):
        checks.check_cuda_fork("fork")


def test_cuda_message_helps_notebook_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(policy, "is_interactive", lambda: True)
    with pytest.raises(LaunchRefusedError, match="restart the kernel"):
        checks.check_cuda_fork("fork")


def test_default_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "is_interactive", lambda: False)
    assert policy.default_start_method() == "spawn"
    monkeypatch.setattr(policy, "is_interactive", lambda: True)
    assert policy.default_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(policy, "_said_spawn", False)
    with pytest.warns(RuntimeWarning, match="spawn here, not fork: CUDA is already initialised"):
        assert policy.default_start_method() == "spawn"


def test_main_importability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a spawn worker runs the parent's __main__ again, by multiprocessing's own rules."""
    fake = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert not checks.main_is_importable()  # python -c, the REPL
    fake.__file__ = "<stdin>"
    assert not checks.main_is_importable()  # python - < script
    fake.__file__ = __file__
    assert checks.main_is_importable()  # python script.py
    fake.__spec__ = importlib.machinery.ModuleSpec("pkg.mod", None, origin=__file__)
    assert checks.main_is_importable()  # python -m pkg.mod
    fake.__spec__ = importlib.machinery.ModuleSpec("pkg.__main__", None, origin=__file__)
    assert not checks.main_is_importable()  # python -m pkg: multiprocessing never runs *.__main__ again
    fake.__spec__ = importlib.machinery.ModuleSpec("__main__", None, origin=__file__)
    assert not checks.main_is_importable()  # python app.pyz


def test_guard_spans_find_every_spelling() -> None:
    source = (
        'x = 1\nif __name__ == "__main__":\n    run()\nif "__main__" == __name__:\n    run()\n'
        'if __name__ == "__main__" and x:\n    run()\nif __name__ in ("__main__",):\n    run()\n'
        'if not __name__ != "__main__":\n    run()\nif x:\n    run()\n'
    )
    assert importable.guard_spans(ast.parse(source)) == [(2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]


UNGUARDED = "import sys\nvalue = fit(3)\n"
GUARDED = 'import sys\nif __name__ == "__main__":\n    value = fit(3)\n'
#: What ``python -m pdb`` and ``runpy.run_path`` do: their own code runs in ``__main__``'s namespace, then
#: executes the script there.
RUNNER = "import pathlib\n\n\n\nexec(compile(pathlib.Path(SCRIPT).read_text(), SCRIPT, 'exec'), globals())\n"


def _run_main(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str, runner: bool = False, own_namespace: bool = False
) -> None:
    """Run ``script`` as the program's ``__main__`` (through a runner like pdb's, or in a namespace of its own as
    cProfile and trace do); its call ``fit(3)`` runs the main-guard check on the caller's frame."""
    path = tmp_path / "script.py"
    path.write_text(script)
    main = types.ModuleType("__main__")
    main.__file__ = str(tmp_path / "runner.py" if own_namespace else path)
    monkeypatch.setitem(sys.modules, "__main__", main)
    namespace: dict[str, Any] = {"__name__": "__main__"} if own_namespace else vars(main)

    def fit(x: int) -> None:
        checks.check_main_guard("spawn", sys._getframe(1), "fit")

    namespace.update(fit=fit, SCRIPT=str(path), __file__=str(path))
    if runner or own_namespace:
        (tmp_path / "runner.py").write_text(RUNNER)
        exec(compile(RUNNER, str(tmp_path / "runner.py"), "exec"), namespace)
    else:
        exec(compile(script, str(path), "exec"), namespace)


@pytest.mark.parametrize("runner", [False, True], ids=["python script.py", "pdb/runpy"])
def test_missing_guard_is_found_in_the_users_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, runner: bool
) -> None:
    with pytest.raises(LaunchRefusedError) as caught:
        _run_main(monkeypatch, tmp_path, UNGUARDED, runner=runner)
    message = str(caught.value)
    assert "Your script script.py (line 2) called the parallel function fit() at import time" in message
    assert 'if __name__ == "__main__":\n        value = fit(3)\n' in message  # the user's own call, moved


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_missing_guard_names_workers_as_what_was_called(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, start_method: str
) -> None:
    """Warm workers made at import time are refused before any rank starts, and the message names
    ``mplaunch.Workers()``, not a parallel function of that name."""
    script = f"import mplaunch\nworkers = mplaunch.Workers(nprocs=1, start_method={start_method!r})\n"
    with pytest.raises(LaunchRefusedError) as caught:
        _run_main(monkeypatch, tmp_path, script)
    message = str(caught.value)
    assert "Your script script.py (line 2) called mplaunch.Workers() at import time" in message, message
    assert "parallel function" not in message
    moved = f"workers = mplaunch.Workers(nprocs=1, start_method={start_method!r})"
    assert f'if __name__ == "__main__":\n        {moved}\n' in message  # the user's own line, moved


@pytest.mark.parametrize("runner", [False, True], ids=["python script.py", "pdb/runpy"])
def test_a_guarded_call_is_never_refused_because_of_a_runners_frame(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, runner: bool
) -> None:
    _run_main(monkeypatch, tmp_path, GUARDED, runner=runner)


def test_a_script_that_workers_do_not_run_again_is_not_judged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """cProfile and trace run the script in a namespace of their own; a worker runs their module, not the
    script, so an unguarded call launches once and is fine."""
    _run_main(monkeypatch, tmp_path, UNGUARDED, own_namespace=True)


def test_describe_unpicklable_names_the_argument() -> None:
    import threading

    text = checks.describe_unpicklable((1, threading.Lock()), {}, None)
    assert text.startswith("positional argument 1 (args[1]: _thread.lock)"), text

    def train(steps: int, lock: object, *rest: object) -> None: ...

    text = checks.describe_unpicklable((1, threading.Lock()), {}, None, train)
    assert text.startswith("positional argument 1 (lock: _thread.lock)"), text  # its name, where the signature has one
    text = checks.describe_unpicklable((1, 2, threading.Lock()), {}, None, train)
    assert text.startswith("positional argument 2 (args[2]: _thread.lock)"), text  # *rest
    with open(__file__) as file:
        text = checks.describe_unpicklable((), {"f": file}, None)
    assert text.startswith("keyword argument 'f' (f: _io.TextIOWrapper)"), text
    assert "pass or return its path (or its data) and open it where it is used" in text


def test_unshare_copies_only_shared_tensors_in_place() -> None:
    from mplaunch import unshare

    private = torch.zeros(3)
    private_address = private.data_ptr()
    shared = torch.zeros(3).share_memory_()
    module = torch.nn.Linear(2, 2)
    module.share_memory()
    weight = module.weight
    args = (private, shared, module)
    assert unshare(args) is args
    assert private.data_ptr() == private_address  # not copied
    assert not shared.is_shared()
    assert torch.equal(shared, torch.zeros(3))
    assert module.weight is weight
    assert not module.weight.is_shared()


def _initialise_cuda_here() -> None:
    torch.cuda._lazy_init()


def test_refused_fork_says_where_cuda_was_first_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    import mplaunch

    initialised: list[bool] = []
    monkeypatch.setattr(checks, "_first_cuda_init", None)
    monkeypatch.delattr(
        torch._C, "_cuda_getDeviceCount", raising=False
    )  # (recorded too: tests/unit/test_cuda_probes.py)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: initialised.append(True))  # a successful initialisation
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", torch.cuda._lazy_init)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(initialised))
    torch.cuda._lazy_init()
    with pytest.raises(LaunchRefusedError, match="call mplaunch.record_cuda_init"):
        checks.check_cuda_fork("fork")
    initialised.clear()
    mplaunch.record_cuda_init()
    mplaunch.record_cuda_init()  # twice is once
    _initialise_cuda_here()
    with pytest.raises(LaunchRefusedError) as caught:
        checks.check_cuda_fork("fork")
    assert "CUDA was first initialised here" in str(caught.value)
    assert "in _initialise_cuda_here" in str(caught.value)
    assert "test_checks.py" in str(caught.value)


def test_recorder_ignores_failed_initialisation(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(checks, "_first_cuda_init", None)
    monkeypatch.setattr(torch.cuda, "_lazy_init", fail)
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", fail)
    checks.record_cuda_init()
    with pytest.raises(AssertionError):
        torch.cuda._lazy_init()
    assert checks._first_cuda_init is None
