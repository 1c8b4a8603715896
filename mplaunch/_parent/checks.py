"""Checks run in the parent before any worker starts. Each raises :class:`LaunchRefusedError` with the fix."""

from __future__ import annotations

import contextlib
import inspect
import linecache
import multiprocessing
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from mplaunch._errors import InvalidOptionError, LaunchRefusedError
from mplaunch._frames import warn_at_user
from mplaunch._parent import devices, policy
from mplaunch._platform import cuda
from mplaunch._wire import pickling, start_objects
from mplaunch._wire.importable import WorkerImports, rerun_main_file, script_source
from mplaunch._worker.debugger import reads_a_terminal


def main_is_importable() -> bool:
    """Tell whether a spawn/forkserver worker runs ``__main__`` again (see :mod:`mplaunch._wire.importable`)."""
    return rerun_main_file(sys.modules.get("__main__")) is not None


_first_cuda_init: list[traceback.FrameSummary] | None = None


def record_cuda_init() -> None:
    """Remember where this process first initialises CUDA's driver, so that a refused ``fork`` can say where.

    Opt-in, for the parent process (e.g. the first cell of a notebook). It wraps the two ways PyTorch runs
    ``cuInit``: ``torch.cuda._lazy_init`` (before the first CUDA operation: a tensor or module on the GPU, most
    ``torch.cuda.*`` calls) and ``torch._C._cuda_getDeviceCount`` (``torch.cuda.is_available()``; also
    ``device_count()`` where NVML does not answer). It keeps the stack of the first call that leaves the driver
    initialised: one capture, once. Calling it again has no effect.

    Example:
        ```python title="first_cell.py"
        import mplaunch
        mplaunch.record_cuda_init()  # before anything touches CUDA
        ```
    """
    if getattr(torch.cuda._lazy_init, "_mplaunch_recorder", False):
        return
    torch.cuda._lazy_init = torch.cuda.random._lazy_init = _recording(torch.cuda._lazy_init)  # type: ignore[attr-defined]
    if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build
        torch._C._cuda_getDeviceCount = _recording(torch._C._cuda_getDeviceCount)


def _recording(original: Callable[[], Any]) -> Callable[[], Any]:
    """Return ``original`` wrapped to keep the stack of its first call that leaves the driver initialised."""

    def recording() -> Any:
        global _first_cuda_init
        if _first_cuda_init is not None or torch.cuda.is_initialized() or cuda.driver_initialised():
            return original()
        stack = traceback.extract_stack()[:-1]
        result = original()
        if torch.cuda.is_initialized() or cuda.driver_initialised():
            _first_cuda_init = stack
        return result

    recording._mplaunch_recorder = True  # type: ignore[attr-defined]
    return recording


def _where_cuda_was_initialised() -> str:
    if _first_cuda_init is None:
        return (
            " To see where CUDA gets initialised, call mplaunch.record_cuda_init() at the start of your program "
            "(the first cell of a notebook)."
        )
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in _first_cuda_init if not f.filename.startswith(torch_dir)][-3:]
    return " CUDA was first initialised here:\n" + "".join(traceback.format_list(frames))


def check_cuda_fork(start_method: str) -> None:
    """Refuse ``fork`` when a forked worker could not use CUDA (:func:`devices.fork_refusal`), saying why."""
    refusal = devices.fork_refusal() if start_method == "fork" else None
    if refusal is None:
        return
    message = (
        f"start_method='fork' cannot be used: {refusal[0]}, so a worker forked from it cannot use CUDA (PyTorch "
        f"would raise 'Cannot re-initialize CUDA in forked subprocess'). Use start_method='spawn' or 'forkserver', "
        f"{refusal[1]}."
    )
    if policy.is_interactive():
        message += " In a notebook, restart the kernel, or use start_method='spawn': it takes functions of cells."
    raise LaunchRefusedError(message + _where_cuda_was_initialised())


def check_not_bootstrapping(name: str = "the function") -> None:
    """Refuse to launch from a worker still importing the parent's ``__main__`` (a missing guard)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise LaunchRefusedError(_guard_message("A worker re-imported your script and it", name, None))


def _guard_message(where: str, name: str, line: str | None) -> str:
    """Return the advice for a call at import time (``name``: a parallel function's, or ``mplaunch.Workers``)."""
    called = name if name.startswith("mplaunch.") else f"the parallel function {name}"
    return (
        f"{where} called {called}() at import time. With start_method 'spawn' or "
        "'forkserver' each worker runs your script again, so the call must be under "
        '`if __name__ == "__main__":`, e.g.\n\n'
        '    if __name__ == "__main__":\n'
        f"        {line or name + '(...)'}\n\n"
        "or use start_method='fork'."
    )


def _same_file(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _main_frame(frame: FrameType | None, path: str) -> FrameType | None:
    """Return the outermost frame running the top-level code of ``__main__``'s file ``path`` (never a runner's)."""
    main = sys.modules.get("__main__")
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and main is not None and frame.f_globals is vars(main):
            if _same_file(code.co_filename, path):
                found = frame
        frame = frame.f_back
    return found


def check_main_guard(start_method: str, frame: FrameType | None, name: str = "the function") -> None:
    """Refuse spawn/forkserver when ``frame`` is in top-level code of a script each worker runs again, naming it."""
    path = rerun_main_file(sys.modules.get("__main__"))
    if start_method == "fork" or path is None:
        return
    main_frame = _main_frame(frame, path)
    source = script_source(path)
    if main_frame is None or source is None:
        return
    line = main_frame.f_lineno
    if not any(start <= line <= end for start, end in source.spans):
        where = f"Your script {os.path.basename(path)} (line {line})"
        raise LaunchRefusedError(_guard_message(where, name, linecache.getline(path, line).strip()))


def describe_unpicklable(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    imports: WorkerImports | None,
    function: Any = None,
    by_value: bool = False,
) -> str:
    """Name the first argument (else the function) that cannot be pickled for ``imports``, the part, and why."""
    how: dict[str, Any] = {"imports": imports, "by_value": by_value, "start_objects": True}
    named = [(f"positional argument {i}", _positional_name(function, i) or f"args[{i}]", v) for i, v in enumerate(args)]
    named += [(f"keyword argument {name!r}", name, value) for name, value in kwargs.items()]
    named.append(("the function", getattr(function, "__name__", "function"), function))
    for what, root, value in named:
        error = pickling.pickle_error(value, **how)
        if error is not None:
            return f"{what} ({pickling.unpicklable_part(value, root, **how)}): {error}"
    return "the captured global state"


def _positional_name(function: Any, index: int) -> str | None:
    """Return the name of ``function``'s parameter that takes positional argument ``index``, if any."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if index < len(parameters) and parameters[index].kind in positional:
        return parameters[index].name
    return None


def check_start_objects(objects: list[Any], start_method: str) -> None:
    """Refuse an object that ``Process.start()`` would fail to send (e.g. a ``Queue`` of a ``fork`` context)."""
    failure = start_objects.rehearse(objects)
    if failure is None:
        return
    culprit, error = failure
    advice = (
        "It was made from a 'fork' context (multiprocessing's default on Linux before Python 3.14): make it "
        f"from multiprocessing.get_context({start_method!r}) instead"
        if "fork context" in str(error)
        else "Create it inside the function, or use start_method='fork'"
    )
    raise LaunchRefusedError(
        f"cannot send the {type(culprit).__qualname__} in the call's arguments to {start_method!r} workers: "
        f"{type(error).__name__}: {str(error).rstrip('.')}. {advice}."
    ) from error


def check_log_dir(log_dir: str | None) -> None:
    """Create ``log_dir`` (with its parents) and refuse one that is a file or is not writable."""
    if log_dir is None:
        return
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as error:
        what = "is a file, not a directory" if os.path.isfile(log_dir) else f"cannot be created ({error.strerror})"
        raise InvalidOptionError(
            f"log_dir={log_dir!r} {what}: pass a directory that can be created and written to, or None."
        ) from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise InvalidOptionError(
            f"log_dir={log_dir!r} is not writable by this user: pass a directory you can write to, or None."
        )


def check_arguments(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, before: str = "launching any worker"
) -> None:
    """Raise here the ``TypeError`` a plain call would raise for wrong arguments."""
    target = getattr(function, "_mplaunch_target", function)
    signature, bound = _signature(target)
    if signature is None:  # builtins and other callables without a signature
        return
    shape = (len(args), tuple(kwargs))  # all that binding looks at: no value is checked
    if shape in bound:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(target, "__qualname__", repr(target))
        raise TypeError(f"{name}(): {error} (checked before {before})") from None
    if len(bound) < 64:
        bound.add(shape)


def post_mortem_terminal(post_mortem: bool) -> bool:
    """Tell whether workers may open the post-mortem debugger; without a terminal, point to ``fn.debug()``."""
    if not post_mortem:
        return False
    interactive = reads_a_terminal() and os.path.exists("/dev/tty")
    if not interactive:
        warn_at_user(
            "post_mortem=True needs a terminal, and this process reads none (a notebook, or input from a pipe): "
            "no debugger opens in the workers. Run the function here with fn.debug(...) and debug it in this "
            "process (%debug in IPython, or pdb.pm()).",
            RuntimeWarning,
        )
    return interactive


#: Per launched function: its code and defaults, ``inspect.signature``, and the argument shapes that bound.
_SIGNATURES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], inspect.Signature | None, set[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _signature(target: Any) -> tuple[inspect.Signature | None, set[tuple[int, tuple[str, ...]]]]:
    """Return ``inspect.signature(target)`` (or ``None``) and the argument shapes known to bind to it (speed)."""
    key = (
        getattr(target, "__code__", None),
        getattr(target, "__defaults__", None),
        getattr(target, "__kwdefaults__", None),
    )
    with contextlib.suppress(KeyError, TypeError):  # not seen, or not weakly referable
        known, signature, bound = _SIGNATURES[target]
        if known == key and key[0] is not None:
            return signature, bound
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        signature = None
    bound = set()
    with contextlib.suppress(TypeError):
        _SIGNATURES[target] = (key, signature, bound)
    return signature, bound
