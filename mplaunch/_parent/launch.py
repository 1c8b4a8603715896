"""The launch, step by step: resolve the options, check, build the worker spec, write the payload, start the
workers, wait for them (:mod:`mplaunch._parent.supervise`), and return their values. Single-node launches start
their processes here; multi-node launches hand that to torch elastic (:mod:`mplaunch._multinode.elastic`)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from mplaunch._config import ParallelConfig
from mplaunch._env import node_setup, outer_launcher
from mplaunch._errors import InvalidOptionError, LaunchRefusedError
from mplaunch._frames import named_original
from mplaunch._output.fds import stdin_for_forks
from mplaunch._output.pump import Pump, routed, worker_fds
from mplaunch._parent import checks, devices, placement, policy, stacks
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.directory import launch_directory
from mplaunch._parent.in_process import run_in_process
from mplaunch._parent.limits import open_files_explained, short_socket_directory
from mplaunch._parent.memory import outcome_files, payload_written
from mplaunch._parent.preemption import Preemption, preemption_notice
from mplaunch._parent.processes import release, start_workers
from mplaunch._parent.report import RunReport
from mplaunch._parent.restarts import run_attempts
from mplaunch._parent.signals import ParentSignalled, ignored_signals, parent_signals, sigchld_handled
from mplaunch._parent.store import Rendezvous, rendezvous
from mplaunch._parent.supervise import Supervisor
from mplaunch._parent.terminal import terminal_kept
from mplaunch._state.python import warn_not_carried
from mplaunch._state.sharing import unshare_verdict
from mplaunch._state.snapshot import ForkState, GlobalState
from mplaunch._wire import transport
from mplaunch._wire.importable import WorkerImports, worker_imports
from mplaunch._wire.mappings import holds_shared_mappings
from mplaunch._wire.records import Payload, WorkerSpec, outcome_name, set_attribute
from mplaunch._wire.watch import Board
from mplaunch._worker.entry import prepare_forks


def _function_reference(function: Any, imports: WorkerImports | None) -> Any:
    """What to send as the function: the decorated object when a worker can import it by name, else the plain
    function, which travels by value (see :mod:`mplaunch._wire.importable`); under fork (no ``imports``), where
    nothing is pickled, the plain function. A copy with other options (``fn.options(...)``) is not what its
    name finds: the decorated object that is goes instead (a worker runs only its plain function, the same),
    so that the function runs with its module's globals and its own file in tracebacks."""
    if imports is not None:
        if imports.can_import(function):
            return function
        original = named_original(function)
        if original is not None and imports.can_import(original):
            return original
    return function._mplaunch_target


def launch(
    function: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: ParallelConfig,
    frame: Any,
    control: LaunchControl | None = None,
) -> Any:
    """Run ``function`` (a ``ParallelFunction``) on ``config.nprocs`` workers and return its result(s);
    ``control`` (a submitted launch's) can stop it."""
    checks.check_not_bootstrapping(_name(function))
    if outer_launcher() is not None:
        return run_in_process(function, args, kwargs, config)
    control = control or LaunchControl()
    started = time.monotonic()
    try:
        # outermost: a SIGTERM unwinds through the clean-ups; the terminal is put back after them
        with terminal_kept(), parent_signals(), open_files_explained():
            return _launch(function, args, kwargs, config, frame, control)
    except BaseException as error:
        set_attribute(error, "report", _report(control, started))
        raise
    finally:
        _report(control, started)


def _report(control: LaunchControl, started: float) -> RunReport:
    """The launch's report, made once, when it ends (on ``control``)."""
    if control.report is None:
        control.report = RunReport(control.ranks, time.monotonic() - started, control.restarts)
    return control.report


def check_call(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: ParallelConfig, frame: Any
) -> bool:
    """Run, in the caller's thread, the checks of a call that depend on where it was made (the main guard
    looks at the caller's current line); return whether the call will start workers (else it runs in-process)."""
    checks.check_not_bootstrapping(_name(function))
    if outer_launcher() is not None:
        return False
    checks.check_arguments(function, args, kwargs)
    checks.check_main_guard(config.start_method or policy.default_start_method(), frame, _name(function))
    devices.check_request(config.devices)
    return True


def _name(function: Any) -> str:
    """The decorated function's name, for messages."""
    return str(getattr(function, "__name__", "the function"))


def _launch(
    function: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: ParallelConfig,
    frame: Any,
    control: LaunchControl,
) -> Any:
    checks.check_arguments(function, args, kwargs)
    checks.check_log_dir(config.log_dir)
    with devices.held(config.devices, control) as names:  # waits while another launch holds the devices
        control.queued = False
        return _launch_on(function, args, kwargs, config, frame, control, names)


def _launch_on(
    function: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: ParallelConfig,
    frame: Any,
    control: LaunchControl,
    names: list[str] | None,
) -> Any:
    """The launch on the devices ``names`` (``None``: every visible one, as the parent sees them)."""
    nprocs = len(names) if names is not None and config.nprocs == "auto" else policy.resolve_nprocs(config.nprocs)
    nodes = node_setup(config.nnodes, config.node_rank, config.rdzv_endpoint)
    if nodes is not None:
        _check_single_node(config)
    start_method = config.start_method or policy.default_start_method()
    checks.check_cuda_fork(start_method)
    checks.check_main_guard(start_method, frame, _name(function))
    if nodes is not None and config.stall_timeout is not None:
        raise InvalidOptionError(
            f"stall_timeout={config.stall_timeout:g} watches the ranks of a one-node launch, and this launch has "
            f"nnodes={nodes.nnodes}: leave stall_timeout=None (heartbeat() does nothing there)."
        )
    imports = worker_imports() if start_method != "fork" or nodes is not None else None
    world_size = nprocs * (nodes.nnodes if nodes else 1)
    if config.console_ranks is not None and not any(rank < world_size for rank in config.console_ranks):
        raise InvalidOptionError(
            f"console_ranks={sorted(config.console_ranks)} names no rank of this launch (ranks 0 to "
            f"{world_size - 1}), so no output would reach the console: pick ranks below {world_size}."
        )
    inherited = start_method == "fork" and nodes is None  # forked workers inherit the state as it is now
    state: GlobalState | ForkState
    if control.state is not None:  # captured when the launch was submitted
        state = control.state
    elif inherited:
        state = ForkState.capture()
    else:
        state = GlobalState.capture()
    payload = Payload(_function_reference(function, imports), args, kwargs, state)
    if isinstance(state, GlobalState) and state.python is not None and not inherited:
        warn_not_carried(state.python)
    wanted_threads = policy.wanted_threads(nprocs)  # read once: the cgroup's CPU quota is four files
    num_threads = policy.worker_threads(nprocs, start_method, wanted_threads)
    placements = placement.plan(
        config,
        nprocs,
        names,
        multinode=nodes is not None,
        threads_kept="OMP_NUM_THREADS" not in os.environ and num_threads >= wanted_threads,
    )
    env_function = placement.env_function(config, start_method) if nodes is not None else None
    with launch_directory() as directory, contextlib.ExitStack() as held:
        spec = WorkerSpec(
            directory=directory,
            nprocs=nprocs,
            start_method=start_method,
            parent_pid=os.getpid(),
            num_threads=num_threads,
            reporting_ranks=frozenset(range(world_size)) if config.return_all else frozenset({0}),
            environ=dict(os.environ) if start_method == "forkserver" and nodes is None else None,
            backend=policy.resolve_backend(config.backend, nprocs, None if names is None else len(names)),
            prefix_output=config.prefix_output,
            post_mortem=checks.post_mortem_terminal(config.post_mortem),
            console_ranks=config.console_ranks,
            log_dir=config.log_dir,
            grace_period=config.grace_period,
            mp_start_method=multiprocessing.get_start_method(allow_none=True),
            unshare=start_method != "fork" or unshare_verdict((args, kwargs), keep_requested=True),
            placements=placements,
            env_function=env_function,
            ignored_signals=ignored_signals(),
            # a cost only some launches need: a plain call without a timeout never asks for stacks
            stacks=config.timeout is not None or config.stall_timeout is not None or control.stacks_wanted,
            # the workers' own usage, for the report: a fork server's are not this process's children,
            # another thread that starts a process may reap a spawned one first (forked ones are not listed),
            # and a caller's SIGCHLD handler may reap any of them first
            board=config.stall_timeout is not None or start_method != "fork" or sigchld_handled(),
        )
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise LaunchRefusedError("backend='nccl' needs CUDA devices and this machine has none: use 'gloo'.")
        if start_method != "fork" or nodes is not None:
            spec = held.enter_context(
                payload_written(payload, spec, imports, memory=nodes is None, keep_shared=nodes is None)
            )
        if nodes is not None:
            from mplaunch._multinode.elastic import launch_nodes

            if start_method == "forkserver":
                short_socket_directory()  # elastic starts the fork server

            with preemption_notice(control, directory, config.preempt_signals, config.preempt_grace) as notice:
                results = launch_nodes(spec, nodes, config, notice)
        else:
            in_memory = payload if start_method == "fork" else None
            preload = _preload(imports, function)
            with preemption_notice(control, directory, config.preempt_signals, config.preempt_grace) as notice:
                results = run_attempts(
                    lambda restart: _attempt(spec, in_memory, config, preload, control, restart, notice),
                    config.max_restarts,
                    control,
                    config.restart_on,
                    config.restart_delay,
                )
    return results if config.return_all else results[0]


def _attempt(
    spec: WorkerSpec,
    payload: Payload | None,
    config: ParallelConfig,
    preload: list[str],
    control: LaunchControl,
    restart: int,
    notice: Preemption,
) -> list[Any]:
    """One attempt of a one-node launch: a fresh rendezvous store, no outcome left by an earlier attempt; none
    once the launch was preempted (e.g. while it waited to restart)."""
    control.restarts = restart
    if notice.noticed:
        raise notice.error({}, 0)
    for rank in range(spec.nprocs if restart else 0):  # a first attempt's directory is new, and empty
        transport.remove(spec.directory, outcome_name(rank))
        stacks.forget(spec.directory, rank)  # the new worker is asked for stacks only once it can dump
    within = config.timeout if control.deadline is None else control.remaining()
    with rendezvous(resolve_within=within) as store:
        spec = dataclasses.replace(
            spec,
            master_addr=store.addr,
            master_port=store.port,
            agent_store=store.agent_store,
            restart_count=restart,
            max_restarts=config.max_restarts,
        )
        with outcome_files(spec) as spec, routed(list(range(spec.nprocs)), spec) as pump:
            spec = dataclasses.replace(spec, output_fds=worker_fds(pump, spec.start_method, spec.nprocs))
            return _run_workers(spec, payload, config, preload, pump, control, store)


def _check_single_node(config: ParallelConfig) -> None:
    """Refuse the options a multi-node launch does not support: there, each node's torch elastic agent decides
    its own restarts, and a node whose ranks are healthy restarts them when another node rejoins."""
    given = [
        f"{name}={getattr(config, name)!r}"
        for name, default in (("restart_on", None), ("restart_delay", 0.0))
        if getattr(config, name) != default
    ]
    if given:
        raise InvalidOptionError(
            f"{', '.join(given)} is not supported with more than one node: torch elastic's agent on each node "
            "restarts that node's workers on its own, so a filter would judge different failures on different "
            "nodes (a rank's error on one, the collective errors it causes on the others), and a node that "
            "refuses or waits looks lost to the others. Leave it out (max_restarts restarts after every failure "
            "there, at once), or run on one node."
        )


def _preload(imports: WorkerImports | None, function: Any) -> list[str]:
    """Modules the fork server imports once, when it starts, so that its workers do not: torch, NumPy's
    random module when this process uses NumPy (restoring its state imports it), mplaunch's worker side, and
    the function's module if the server can import it by name from the same file (the rule of
    :mod:`mplaunch._wire.importable`: a module loaded from a file path, or ``pkg.__main__``, is never imported
    there). Only the first forkserver launch of a process starts the server, so later functions from other
    modules are imported by each worker."""
    modules = ["__main__", "torch", "mplaunch._worker.entry"]
    if "numpy" in sys.modules:
        modules.append("numpy.random")  # imported lazily by NumPy 2; restoring its state would import it
    module = getattr(function, "__module__", None)
    if imports is not None and module and module != "__main__" and imports.module_importable(module):
        modules.append(module)
    modules.append("mplaunch._worker.forkserver_freeze")  # last: what the server imported is then left to it
    return modules


def _run_workers(
    spec: WorkerSpec,
    payload: Payload | None,
    config: ParallelConfig,
    preload: list[str],
    pump: Pump | None,
    control: LaunchControl,
    store: Rendezvous,
) -> list[Any]:
    processes: list[BaseProcess] = []
    board: Board | None = None
    if spec.board:
        try:
            board = Board(spec.directory, spec.nprocs, create=True)  # heartbeats, usage; zeroed
        except (OSError, ValueError):
            spec = dataclasses.replace(spec, board=False)  # no heartbeats: the launch runs unwatched
    supervisor = Supervisor(
        spec, processes, config.timeout, config.grace_period, control, store, config.stall_timeout, board
    )
    pipe: tuple[int, int] | None = None  # large fork arguments: see _answer_unshare
    stop_signal: int = signal.SIGTERM
    try:
        if spec.start_method == "fork" and spec.unshare is None:
            pipe = os.pipe()
            spec = dataclasses.replace(spec, unshare_pipe=pipe)
        noting = _noting_pids(supervisor.started, pump)
        with stdin_for_forks(spec.start_method) as stdin:  # (under fork: what each rank takes as its stdin)
            forked = [(made,) for made in prepare_forks(spec, stdin)] if spec.start_method == "fork" else []
            start_workers(spec, payload, preload, noting, rank_args=forked)
        if pipe is not None:
            _answer_unshare(pipe, spec.nprocs)
        if pump is not None:
            pump.start()  # drains the pipes; workers are started (no fork while its thread runs)
        results: list[Any] = supervisor.wait()
        return results
    except ParentSignalled as received:
        stop_signal = received.signum  # forwarded: the workers are stopped with the signal the parent got
        raise
    finally:
        for fd in pipe or ():
            os.close(fd)
        try:
            supervisor.stop(stop_signal)
            control.ranks = supervisor.report()
        finally:
            if board is not None:
                board.close()
            for process in processes:
                release(process)


def _noting_pids(started: Callable[[BaseProcess], None], pump: Pump | None) -> Callable[[BaseProcess], None]:
    """``started``, also telling the pump each rank's pid (for ``prefix_output`` templates with ``{pid}``)."""
    if pump is None:
        return started
    ranks = iter(range(len(pump.fds)))

    def note(process: BaseProcess) -> None:
        started(process)
        if process.pid is not None:
            pump.pids[next(ranks)] = process.pid

    return note


def _answer_unshare(pipe: tuple[int, int], nprocs: int) -> None:
    """Tell forked workers with large arguments whether to look in them for memory to make private: whether
    this process holds a result mapped shared by mplaunch. Memory the user shared (``share_memory_()``) stays
    shared (``keep_requested``), and mplaunch's own shared bookkeeping (the heartbeat board, the preemption
    flag) holds no argument, so ``/proc/self/maps``, which lists all of them, is not the question."""
    os.write(pipe[1], (b"1" if holds_shared_mappings() else b"0") * nprocs)
