"""A debugger in a rank: ``breakpoint()`` on the caller's terminal, one rank at a time; and
``post_mortem=True``: pdb at the failing frame of the first rank that raises, on the caller's terminal.

The rank opens the terminal itself (``/dev/tty``, its controlling terminal, which it shares with the parent)
and makes its own process group the terminal's foreground group while the debugger runs, so that it may
read the keyboard (a background group reading it would be stopped by SIGTTIN) and Ctrl-C reaches it; then it
gives the terminal back to the group that had it. The other ranks go on meanwhile: the launch sees the
failure only once this rank ends. One rank debugs at a time: the first to create a marker file in the launch
directory.
"""

from __future__ import annotations

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
    """Open pdb at the frame that raised ``error``, on the terminal, if this rank is the first to fail and
    the launching process is in the terminal's foreground; return when the session ends (``c`` or ``q``)."""
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
    """pdb with ``(Pdb rank N)`` as its prompt, holding the launch's debugger lock until it continues or
    quits, so that the ranks of a launch debug one at a time on the shared terminal."""

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
    """Make ``breakpoint()`` in this rank open pdb on the caller's terminal, one rank at a time, the prompt
    naming the rank (:class:`_RankPdb`). Without a terminal (a notebook's rank, input from a pipe) it says
    so on stderr, points to ``fn.debug()``, and the rank goes on, rather than pdb reading an empty stdin and
    raising ``BdbQuit``. A hook the user set (``sys.breakpointhook``, ``PYTHONBREAKPOINT``) is left alone; a
    Jupyter kernel's (its debugger's, inherited by a forked rank) is not the user's. In a rank forked from a
    kernel, ``input()`` raises ``EOFError`` at once instead of waiting for the kernel's input box.

    Args:
        spec: the launch's spec (its directory holds the lock that lets one rank debug at a time).
        rank: this worker's global rank, for the prompt.
        plan: what to do, decided by the parent before it forked this rank (:func:`breakpoint_plan`), else
            decided here.
    """
    plan = plan or breakpoint_plan(os.environ.get("PYTHONBREAKPOINT"))
    if plan.forget_input:
        _forget_kernel_input()
    if plan.hook:
        sys.breakpointhook = _rank_hook(rank, os.path.join(spec.launch.directory, _BREAKPOINT_LOCK))


@dataclasses.dataclass(frozen=True)
class BreakpointPlan:
    """What :func:`install_breakpoint_hook` does in a rank: replace a Jupyter kernel's ``input()`` and
    ``getpass()`` (``forget_input``), and install the rank's ``breakpoint()`` hook (``hook``)."""

    forget_input: bool
    hook: bool


def breakpoint_plan(variable: str | None) -> BreakpointPlan:
    """Decide what :func:`install_breakpoint_hook` does in a rank that has this process's hooks (the parent
    asks before it forks the ranks, which inherit them); ``variable``: the rank's ``PYTHONBREAKPOINT``."""
    import builtins

    getpass: Any = sys.modules.get("getpass")
    forget = _from_a_kernel(builtins.input) or (getpass is not None and _from_a_kernel(getpass.getpass))
    own = sys.breakpointhook is not sys.__breakpointhook__ and not _from_a_kernel(sys.breakpointhook)
    return BreakpointPlan(forget, not own and not variable)


def _rank_hook(rank: int, path: str) -> Callable[..., None]:
    """Rank ``rank``'s ``sys.breakpointhook`` (see :func:`install_breakpoint_hook`); ``path``: the lock file
    that lets one rank debug at a time."""

    def hook(*args: object, **kwargs: object) -> None:
        if not _reads_a_terminal():
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


#: Modules whose hooks a Jupyter kernel installs (its debugger, its input box): in a rank forked from the
#: kernel they would talk to the kernel's front end over the kernel's own connection, which is not the rank's.
_KERNEL_MODULES = ("ipykernel", "debugpy", "pydevd", "_pydevd", "IPython")


def _from_a_kernel(function: object) -> bool:
    """Whether ``function`` belongs to a Jupyter kernel (see :data:`_KERNEL_MODULES`), not to the user."""
    module = getattr(function, "__module__", None) or getattr(getattr(function, "__func__", None), "__module__", "")
    return str(module).split(".")[0] in _KERNEL_MODULES


def _no_input(*args: object, **kwargs: object) -> str:
    raise EOFError(
        "input() in a rank: a rank of a notebook's launch has no input box (the kernel's is the notebook's). "
        "Pass the value as an argument, or debug the function in this process with fn.debug(...)."
    )


def _forget_kernel_input() -> None:
    """In a rank forked from a Jupyter kernel: ``input()`` and ``getpass.getpass()`` are the kernel's, which
    ask the notebook for an input box over the kernel's connection; in the rank they would wait forever (pdb
    too, which reads with ``input()``). They raise ``EOFError`` at once instead, as a spawned rank's do."""
    import builtins

    if _from_a_kernel(builtins.input):
        builtins.input = _no_input
    getpass: Any = sys.modules.get("getpass")
    if getpass is not None and _from_a_kernel(getpass.getpass):
        getpass.getpass = _no_input


def _reads_a_terminal() -> bool:
    """Whether this process's ``sys.stdin`` is a terminal (a rank started from an interactive shell)."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, OSError, ValueError):
        return False
