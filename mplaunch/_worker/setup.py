"""How a process becomes a rank: signals, the parent's death, exit handlers, output, environment, the debugger.

A stop signal ends the function as :class:`Terminated` / :class:`Interrupted`; the outcome is then
``Signalled``, whatever the function raises after it. Once the outcome is decided, signals are only noted."""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

from mplaunch._env import apply_environment, rank_environment, replacing
from mplaunch._output.rank_streams import take_fds, terminal_stdin
from mplaunch._platform import forks
from mplaunch._platform.csignal import SIG_DFL, SIG_IGN, getsignal, pthread_sigmask, set_handler
from mplaunch._platform.environ import ForkEnviron, replace_environ
from mplaunch._platform.proctree import become_subreaper, set_parent_death_signal
from mplaunch._wire.inherited import close_memory_files
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker import apply_placement as placement
from mplaunch._worker.children import stop_children
from mplaunch._worker.debugger import BreakpointPlan, breakpoint_plan, install_breakpoint_hook
from mplaunch._worker.exit import InheritedLogging, keep_inherited
from mplaunch._worker.outcome import STOP_SIGNALS, stop_own_children
from mplaunch._worker.process_group import forget_inherited_groups
from mplaunch._worker.rendezvous import follow_own_rendezvous
from mplaunch._worker.state import state


def _die_with_parent(parent_pid: int, start_method: str) -> None:
    """Make this worker die with the launching process, even by SIGKILL: ``PR_SET_PDEATHSIG``, as torch's spawn;
    under forkserver (the server outlives the launcher) a thread waits on its pidfd. Exit now if it is gone."""
    if not sys.platform.startswith("linux"):
        return
    if start_method != "forkserver":
        if not set_parent_death_signal(signal.SIGKILL):
            return
        if os.getppid() != parent_pid:
            os._exit(1)
        return
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # kernel < 5.3
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mplaunch-parent-watch", daemon=True).start()


class Terminated(SystemExit):
    """Raised in a worker by SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 or SIGUSR2 (a ``SystemExit``: ``finally`` runs)."""


class Interrupted(KeyboardInterrupt):
    """Raised in a worker by SIGINT sent to it."""


def _on_signal(signum: int, frame: object) -> None:
    first = state.signal_received is None
    if first:
        state.signal_received, state.signal_at = signum, time.monotonic()
    if first and not state.outcome_decided:
        # before unwinding: e.g. DataLoader workers would print about a vanished rank
        stop_children(0.25, kill=False)
        # the unwinding's uncatchable errors (a __del__, a thread) are dropped; finally blocks still print
        sys.unraisablehook = _ignore
        threading.excepthook = _ignore
        raise Interrupted() if signum == signal.SIGINT else Terminated(128 + signum)


def _ignore(*args: object) -> None:
    """Swallow an unraisable or thread exception."""


@forks.in_child
def _default_signals() -> None:
    """Restore the default stop signals in a process a worker forks (in any other child: nothing)."""
    if state.pid == -1:
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def set_threads(num_threads: int) -> None:
    if not state.environ_made:  # (the parent put OMP_NUM_THREADS in a made one: see _rank_fork_changes)
        placement.set_changed({"OMP_NUM_THREADS": str(num_threads)})
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


@dataclasses.dataclass(frozen=True)
class Forked:
    """What the parent makes for a rank before forking it (a page a forked rank writes is copied); ``None``: its own."""

    environ: ForkEnviron | None  # the rank's whole environment
    stdin: TextIO | None  # its sys.stdin
    logging: InheritedLogging  # the handlers it inherits and leaves to the parent
    groups: bool  # the parent has a default process group, which the rank forgets
    flag: bool  # the launch has a preemption flag for the rank to map
    debugger: BreakpointPlan


def start(
    spec: WorkerSpec, on_interrupt: Callable[[int, Any], None] | None = None, forked: Forked | None = None
) -> None:
    """Set up signals, parent death and exit handlers: a worker's first steps; ``on_interrupt``: a SIGINT handler."""
    state.pid, state.leaving = os.getpid(), None
    for signum in STOP_SIGNALS:  # one the caller ignores (nohup: SIGHUP) is ignored here too
        ignored = signum in spec.launch.ignored_signals and signum != signal.SIGTERM  # SIGTERM: how a launch stops it
        set_handler(signum, SIG_IGN if ignored else _on_signal)
    if spec.launch.own_group:  # (SIGINT ignored until now: one pending came to the caller's group)
        os.setpgid(0, 0)
        set_handler(signal.SIGINT, _on_signal)
    if on_interrupt is not None:
        set_handler(signal.SIGINT, on_interrupt)
    if getsignal(signal.SIGCHLD) == SIG_IGN:  # inherited: the rank's children's codes would be lost
        set_handler(signal.SIGCHLD, SIG_DFL)
    _die_with_parent(spec.launch.parent_pid, spec.launch.start_method)
    # the parent's atexit handlers are not the rank's; a forked rank leaves them (each unregister copies a page)
    # and ends before them (exit_handlers)
    state.parents_exits_kept = forked is not None and spec.launch.start_method == "fork"
    if spec.launch.start_method != "spawn" and not state.parents_exits_kept:
        atexit._clear()
    atexit.register(stop_own_children, spec.launch.grace_period)  # first registered: runs after the user's handlers
    if spec.launch.start_method == "fork":
        keep_inherited(None if forked is None else forked.logging)  # the parent's open files are the parent's to flush
        if forked is None or forked.groups:
            forget_inherited_groups()  # the parent's process groups: their threads did not survive the fork
    if spec.launch.start_method != "fork":  # a forked worker has the parent's already
        # a rank's own default is the parent's choice, else the platform's (as in a process torchrun starts)
        multiprocessing.set_start_method(spec.launch.mp_start_method, force=True)
    # but with own_group, the rank stays in the caller's group (a terminal's foreground job); orphans stay in its tree
    become_subreaper()
    terminal_stdin(None if forked is None else forked.stdin)
    pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked while starting: may raise now


def rank_changes(spec: WorkerSpec, rank: int) -> dict[str, str | None]:
    """Return the changes that make a process rank ``rank``: torchrun's variables, ``None`` for ones removed."""
    return replacing(
        rank_environment(
            rank,
            spec.launch.nprocs,
            spec.attempt.master_addr,
            spec.attempt.master_port,
            agent_store=spec.attempt.agent_store,
            restart_count=spec.attempt.restart_count,
            max_restarts=spec.launch.max_restarts,
        )
    )


def set_up(
    rank: int, spec: WorkerSpec, on_interrupt: Callable[[int, Any], None] | None = None, forked: Forked | None = None
) -> None:
    """Make this process rank ``rank`` of a one-node launch; ``forked``: what the parent made, else made here."""
    start(spec, on_interrupt, forked)
    take_fds(spec.attempt.output_fds, rank, rank)
    if spec.launch.start_method == "fork":  # the inherited memory files (other ranks', launches') but its outcome's
        close_memory_files(set() if spec.outcome_fd is None else {spec.outcome_fd.fd})
    if spec.launch.environ is not None:
        replace_environ(spec.launch.environ)
    state.environ_made = forked is not None and forked.environ is not None  # (not a process the rank forked)
    if forked is not None and forked.environ is not None:
        forked.environ.install()
    else:
        apply_environment(os.environ, rank_changes(spec, rank))
    follow_own_rendezvous()  # a rank that sets its own MASTER_PORT (mp.spawn code) gets that rendezvous
    if forked is not None:
        plan = forked.debugger
    else:
        variable = placement.environment(spec, rank).get("PYTHONBREAKPOINT", os.environ.get("PYTHONBREAKPOINT"))
        plan = breakpoint_plan(variable)
    install_breakpoint_hook(spec, rank, plan)
