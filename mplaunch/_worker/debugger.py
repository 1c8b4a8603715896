"""A debugger in a rank: ``breakpoint()`` one rank at a time, and ``post_mortem=True`` in the first failing rank.

Post-mortem, the rank opens ``/dev/tty`` and makes its group the foreground while pdb runs (a background reader
gets SIGTTIN; Ctrl-C reaches it). The first rank to create a marker file in the launch directory debugs."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import fcntl
import os
import pdb
import signal
import sys
from collections.abc import Callable
from typing import Any

from mplaunch._wire.spec import WorkerSpec

_MARKER = "post-mortem"


def post_mortem(error: BaseException, spec: WorkerSpec, rank: int) -> None:
    """Open pdb at ``error``'s frame if this rank failed first and the launch has the terminal's foreground."""
    if not isinstance(error, Exception) or error.__traceback__ is None:
        return  # SystemExit, KeyboardInterrupt: not a bug to look at
    try:
        os.close(os.open(os.path.join(spec.launch.directory, _MARKER), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return  # another rank is (or was) in the debugger
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # no controlling terminal
    try:
        _debug_on(fd, error, rank, os.getpgid(spec.launch.parent_pid))
    finally:
        os.close(fd)


def _debug_on(fd: int, error: BaseException, rank: int, parent_group: int) -> None:
    """Run pdb on terminal ``fd`` as its foreground group, if ``parent_group`` has it now."""
    foreground = os.tcgetpgrp(fd)
    if foreground != parent_group:
        return  # the launch runs in the background: the keyboard is someone else's
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may then take the terminal
    try:
        os.tcsetpgrp(fd, os.getpgrp())
        try:
            with (
                open(fd, encoding="utf-8", errors="replace", closefd=False) as stdin,
                open(fd, "w", encoding="utf-8", buffering=1, closefd=False) as stdout,
            ):
                stdout.write(
                    f"\nmplaunch: rank {rank} raised {type(error).__name__}: {error}\n"
                    "Post-mortem debugger at the failing line; 'q' or 'c' ends it, and the launch goes on.\n"
                )
                debugger = pdb.Pdb(stdin=stdin, stdout=stdout)
                debugger.prompt = f"(Pdb rank {rank}) "
                debugger.reset()
                debugger.interaction(None, error.__traceback__)
        finally:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(fd, foreground)
    finally:
        signal.signal(signal.SIGTTOU, previous)


_BREAKPOINT_LOCK = "breakpoint.lock"


class _RankPdb(pdb.Pdb):
    """pdb prompting ``(Pdb rank N)``, holding the launch's debugger lock until it continues or quits."""

    def __init__(self, rank: int, lock: int) -> None:
        super().__init__()
        self.prompt = f"(Pdb rank {rank}) "
        self._lock = lock

    def _release(self) -> None:
        if self._lock >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                os.close(self._lock)
            self._lock = -1

    def set_continue(self) -> None:
        super().set_continue()
        self._release()

    def set_quit(self) -> None:
        self._release()
        super().set_quit()


def install_breakpoint_hook(spec: WorkerSpec, rank: int, plan: BreakpointPlan | None = None) -> None:
    """Make ``breakpoint()`` open pdb on the terminal, one rank at a time; a user's hook is kept, a kernel's is not."""
    plan = plan or breakpoint_plan(os.environ.get("PYTHONBREAKPOINT"))
    if plan.forget_input:
        _forget_kernel_input()
    if plan.hook:
        sys.breakpointhook = _rank_hook(rank, os.path.join(spec.launch.directory, _BREAKPOINT_LOCK))


@dataclasses.dataclass(frozen=True)
class BreakpointPlan:
    """What :func:`install_breakpoint_hook` does: replace a kernel's ``input()``; install the rank's hook."""

    forget_input: bool
    hook: bool


def breakpoint_plan(variable: str | None) -> BreakpointPlan:
    """Decide the :class:`BreakpointPlan` of a rank with this process's hooks and ``PYTHONBREAKPOINT=variable``."""
    getpass: Any = sys.modules.get("getpass")
    forget = _from_a_kernel(builtins.input) or (getpass is not None and _from_a_kernel(getpass.getpass))
    own = sys.breakpointhook is not sys.__breakpointhook__ and not _from_a_kernel(sys.breakpointhook)
    return BreakpointPlan(forget, not own and not variable)


def _rank_hook(rank: int, path: str) -> Callable[..., None]:
    """Return rank ``rank``'s ``sys.breakpointhook``, serialised by the lock file ``path``."""

    def hook(*args: object, **kwargs: object) -> None:
        if not reads_a_terminal():
            print(
                f"mplaunch: breakpoint() in rank {rank} skipped: this rank has no terminal to read (a notebook, "
                "or input from a pipe). Debug the function in this process with fn.debug(...), or run the "
                "program from a terminal.",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank's session first: one at a time
        except OSError:
            lock = -1
        _RankPdb(rank, lock).set_trace(sys._getframe(1))

    return hook


#: Modules whose hooks a Jupyter kernel installs: in a forked rank they would use the kernel's connection.
_KERNEL_MODULES = ("ipykernel", "debugpy", "pydevd", "_pydevd", "IPython")


def _from_a_kernel(function: object) -> bool:
    """Return whether ``function`` belongs to a Jupyter kernel, not to the user."""
    module = getattr(function, "__module__", None) or getattr(getattr(function, "__func__", None), "__module__", "")
    return str(module).split(".")[0] in _KERNEL_MODULES


def _no_input(*args: object, **kwargs: object) -> str:
    raise EOFError(
        "input() in a rank: a rank of a notebook's launch has no input box (the kernel's is the notebook's). "
        "Pass the value as an argument, or debug the function in this process with fn.debug(...)."
    )


def _forget_kernel_input() -> None:
    """Make a kernel's ``input()`` and ``getpass()`` raise ``EOFError``: in a forked rank they wait forever."""
    if _from_a_kernel(builtins.input):
        builtins.input = _no_input
    getpass: Any = sys.modules.get("getpass")
    if getpass is not None and _from_a_kernel(getpass.getpass):
        getpass.getpass = _no_input


def reads_a_terminal() -> bool:
    """Return whether ``sys.stdin`` is a terminal."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, OSError, ValueError):
        return False
