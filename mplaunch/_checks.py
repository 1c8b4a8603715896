"""Checks run in the parent before any worker starts. Each raises :class:`LaunchRefusedError` with the fix."""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from mplaunch import _transport
from mplaunch._errors import LaunchRefusedError


def is_interactive() -> bool:
    """Whether this is an interactive session: the REPL, ``python -i``, or an IPython/Jupyter shell."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def default_start_method() -> str:
    """The start method used when none is given: ``fork`` in an interactive session where ``fork`` exists and
    CUDA is not initialised, ``spawn`` otherwise (spawn works there too: see :func:`main_is_importable`)."""
    if is_interactive() and "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def main_is_importable() -> bool:
    """Whether a ``spawn``/``forkserver`` worker can import the parent's ``__main__`` (a script file or a
    ``python -m`` module); not so for ``python -c``, stdin, the REPL or a notebook."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


_first_cuda_init: list[traceback.FrameSummary] | None = None


def record_cuda_init() -> None:
    """Remember where CUDA is first initialised in this process, so that a refused ``fork`` can say where.

    Opt-in, for the parent process (e.g. the first cell of a notebook). It wraps ``torch.cuda._lazy_init``,
    which PyTorch calls before the first CUDA operation (a tensor or module moved to the GPU, most
    ``torch.cuda.*`` calls), and keeps the call stack of the first successful initialisation. Costs one
    stack capture, once. Calling it again has no effect; if CUDA is already initialised there is nothing
    left to record.

    Example:
        >>> import mplaunch
        >>> mplaunch.record_cuda_init()
    """
    if getattr(torch.cuda._lazy_init, "_mplaunch_recorder", False):
        return
    original: Callable[[], None] = torch.cuda._lazy_init

    def recording_lazy_init() -> None:
        global _first_cuda_init
        if _first_cuda_init is not None or torch.cuda.is_initialized():
            original()
            return
        stack = traceback.extract_stack()[:-1]
        original()
        _first_cuda_init = stack

    recording_lazy_init._mplaunch_recorder = True  # type: ignore[attr-defined]
    torch.cuda._lazy_init = recording_lazy_init
    torch.cuda.random._lazy_init = recording_lazy_init  # type: ignore[attr-defined]


def _where_cuda_was_initialised() -> str:
    if _first_cuda_init is None:
        return (
            " To see where CUDA gets initialised, call mplaunch.record_cuda_init() at the start of your program "
            "(the first cell of a notebook)."
        )
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in _first_cuda_init if not f.filename.startswith(torch_dir)][-3:]
    where = "".join(traceback.format_list(frames))
    return f" CUDA was first initialised here:\n{where}"


def check_cuda_fork(start_method: str) -> None:
    """Refuse ``fork`` when CUDA is initialised in the parent: a forked child cannot use CUDA.

    ``torch.cuda.is_available()`` and ``device_count()`` do not initialise CUDA and are not a problem.
    ``forkserver`` children fork from a clean server process, so they are not affected.
    """
    if start_method != "fork" or not torch.cuda.is_initialized():
        return
    message = (
        "start_method='fork' cannot be used: CUDA is already initialised in this process, and a forked worker "
        "cannot use CUDA (PyTorch would raise 'Cannot re-initialize CUDA in forked subprocess'). Use "
        "start_method='spawn' or 'forkserver', or do not touch CUDA (tensors or models on the GPU, "
        "torch.cuda.* calls other than is_available()/device_count()) before launching."
    )
    if is_interactive():
        message += (
            " In a notebook, restart the kernel and launch before any CUDA use, or use start_method='spawn', "
            "which works with functions defined in cells."
        )
    raise LaunchRefusedError(message + _where_cuda_was_initialised())


def check_not_bootstrapping() -> None:
    """Refuse to launch from a worker that is still importing the parent's ``__main__`` (a missing guard)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise LaunchRefusedError(_MAIN_GUARD_MESSAGE.format(where="a worker re-imported your script and"))


_MAIN_GUARD_MESSAGE = (
    "{where} called a parallel function at import time. With start_method 'spawn' or 'forkserver' each worker "
    'imports your script again, so the call must be under `if __name__ == "__main__":`, e.g.\n\n'
    '    if __name__ == "__main__":\n'
    "        result = train()\n\n"
    "or use start_method='fork'."
)


def _main_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame running ``__main__``'s top-level code, if any."""
    main = sys.modules.get("__main__")
    found = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and main is not None and frame.f_globals is vars(main):
            found = frame
        frame = frame.f_back
    return found


def _guard_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """Line spans of the ``if`` blocks whose test involves ``__name__`` and ``"__main__"`` (any spelling:
    ``==``, ``in``, combined with ``and``, negated)."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            parts = list(ast.walk(node.test))
            has_name = any(isinstance(n, ast.Name) and n.id == "__name__" for n in parts)
            has_main = any(isinstance(n, ast.Constant) and n.value == "__main__" for n in parts)
            if has_name and has_main:
                spans.append((node.lineno, node.end_lineno or node.lineno))
    return spans


def defined_in_main_guard(function: Any) -> bool:
    """Whether ``function`` belongs to ``__main__`` and is defined inside its ``if __name__ == "__main__":``
    block, where a ``spawn``/``forkserver`` worker that re-imports the script will not find it."""
    main = sys.modules.get("__main__")
    code = getattr(function, "__code__", None)
    path = getattr(main, "__file__", None)
    if getattr(function, "__module__", None) != "__main__" or code is None or not isinstance(path, str):
        return False
    spans = _guard_spans_of_file(path) or []
    return any(start <= code.co_firstlineno <= end for start, end in spans)


_spans_cache: dict[tuple[str, float], list[tuple[int, int]] | None] = {}


def _guard_spans_of_file(path: str) -> list[tuple[int, int]] | None:
    """The guard blocks of a script, parsed once per version of the file; ``None`` if it cannot be read."""
    try:
        key = (path, os.stat(path).st_mtime)
    except OSError:
        return None
    if key not in _spans_cache:
        try:
            with open(path, encoding="utf-8") as file:
                _spans_cache[key] = _guard_spans(ast.parse(file.read()))
        except (OSError, SyntaxError, ValueError):
            _spans_cache[key] = None
    return _spans_cache[key]


def check_main_guard(start_method: str, frame: FrameType | None) -> None:
    """Refuse ``spawn``/``forkserver`` when the call comes from top-level script code outside an
    ``if __name__ == "__main__":`` block, which every worker would run again on import.

    Args:
        start_method: the start method of the launch.
        frame: the caller's frame; the outermost ``__main__`` top-level frame above it is examined.
    """
    if start_method == "fork" or not main_is_importable():
        return
    main_frame = _main_frame(frame)
    path = getattr(sys.modules["__main__"], "__file__", None)
    if main_frame is None or path is None:
        return
    spans = _guard_spans_of_file(path)
    line = main_frame.f_lineno
    if spans is not None and not any(start <= line <= end for start, end in spans):
        where = f"Your script {os.path.basename(path)} (line {line})"
        raise LaunchRefusedError(_MAIN_GUARD_MESSAGE.format(where=where))


def describe_unpicklable(args: tuple[Any, ...], kwargs: dict[str, Any], by_value: bool) -> str:
    """Name the first argument that cannot be pickled, and why; ``"the function"`` if every argument can."""
    for index, value in enumerate(args):
        error = _transport.pickle_error(value, by_value=by_value)
        if error is not None:
            return f"positional argument {index} ({type(value).__qualname__}): {error}"
    for name, value in kwargs.items():
        error = _transport.pickle_error(value, by_value=by_value)
        if error is not None:
            return f"keyword argument {name!r} ({type(value).__qualname__}): {error}"
    return "the function or the captured global state"


def check_log_dir(log_dir: str | None) -> None:
    """Create ``log_dir`` (with its parents) here, before any worker starts, and check that it is a writable
    directory.

    Raises:
        InvalidOptionError: it is an existing file, cannot be created, or is not writable.
    """
    if log_dir is None:
        return
    from mplaunch._errors import InvalidOptionError

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
