"""A launch, step by step: resolve the options, check, build the spec, write the payload, start the ranks
(:mod:`mplaunch._parent.ranks`) and run the call, restarting after a failure; multi-node goes to torch elastic."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from mplaunch._config import ParallelConfig, check_mode, refused_in
from mplaunch._env import NodeSetup, node_setup, outer_launcher
from mplaunch._errors import InvalidOptionError, LaunchRefusedError, set_attribute
from mplaunch._frames import named_original
from mplaunch._output.pump import routed, worker_fds
from mplaunch._parent import checks, devices, placement, policy, stacks
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.directory import launch_directory, log_dir_held
from mplaunch._parent.limits import open_files_explained, short_socket_directory
from mplaunch._parent.memfiles import Written, outcome_files, payload_written
from mplaunch._parent.parent_signals import ignored_signals, own_group, parent_signals, sigchld_handled
from mplaunch._parent.preemption import Preemption, preemption_notice
from mplaunch._parent.ranks import STARTED, Ranks, board_for, values
from mplaunch._parent.restarts import run_attempts
from mplaunch._parent.store import Rendezvous, rendezvous
from mplaunch._parent.stream import Stream
from mplaunch._parent.terminal import terminal_kept
from mplaunch._reports import RunReport
from mplaunch._state.python import warn_not_carried
from mplaunch._state.snapshot import ForkState, GlobalState, for_launch
from mplaunch._wire import transport
from mplaunch._wire.board import Board
from mplaunch._wire.importable import WorkerImports, worker_imports
from mplaunch._wire.records import Payload, outcome_name
from mplaunch._wire.spec import AttemptSpec, LaunchSpec, RankFds
from mplaunch._worker.entry import run


@dataclasses.dataclass(frozen=True)
class CallRequest:
    """One call of a decorated function as its caller made it, checked once, in the caller's thread."""

    function: Any  # the ParallelFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    submitted: bool = False  # made with submit(): it runs in a thread of its own

    @property
    def streams(self) -> bool:
        """Whether the function is a generator function, whose values stream from the ranks."""
        return inspect.isgeneratorfunction(self.function._mplaunch_target)

    @property
    def config(self) -> ParallelConfig:
        return self.function.config  # type: ignore[no-any-return]

    def check(self, frame: Any) -> bool:
        """Run the checks that need no start; return whether it starts workers (else it runs here, under a launcher)."""
        name = str(getattr(self.function, "__name__", "the function"))
        checks.check_not_bootstrapping(name)
        if outer_launcher() is not None:
            return False
        for mode in ["submit()" if self.submitted else "call"] + (["generator function"] if self.streams else []):
            check_mode(self.config, mode)  # (the ways of calling, as mplaunch._config.MODES names them)
        checks.check_arguments(self.function, self.args, self.kwargs)
        checks.check_main_guard(self.config.start_method or policy.default_start_method(), frame, name)
        devices.check_request(self.config.devices)
        checks.check_log_dir(self.config.log_dir)
        return True


def launch(request: CallRequest, control: LaunchControl) -> Any:
    """Run a checked call on its workers and return its result(s); ``control`` (a submitted one's) can stop it."""
    # outermost: a SIGTERM unwinds through the clean-ups; the terminal is put back after them
    with terminal_kept(), parent_signals():
        return drained(_reported(_launch(request, control), control))


def launch_stream(
    request: CallRequest, control: LaunchControl, reported: Callable[[RunReport], None] | None = None
) -> Stream[Any]:
    """Start a checked call of a generator function; return its :class:`Stream` at once, its report to ``reported``."""
    steps = _reported(_launch(request, control), control)

    def ended() -> None:
        control.close()
        if control.report is not None and reported is not None:
            reported(control.report)

    stream: Stream[Any] = Stream(steps, ended, request.config.return_all)
    stream.prime()  # to the start of the ranks: a refusal is raised here, by the call
    return stream


def drained(steps: Generator[tuple[int, Any], None, Any]) -> Any:
    """Run a launch (or a call) to its end, dropping what it yields; return its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _reported(steps: Generator[tuple[int, Any], None, Any], control: LaunchControl) -> Generator[Any, None, Any]:
    """Run ``steps``; make its report once it ends (on ``control``, and on an error it raises)."""
    started = time.monotonic()
    try:
        with open_files_explained():
            return (yield from steps)
    except BaseException as error:
        set_attribute(error, "report", _report(control, started))
        raise
    finally:
        _report(control, started)


def _report(control: LaunchControl, started: float) -> RunReport:
    """Return the launch's report, made once (on ``control``)."""
    if control.report is None:
        control.report = RunReport(control.ranks, time.monotonic() - started, control.restarts)
    return control.report


def _launch(request: CallRequest, control: LaunchControl) -> Generator[tuple[int, Any], None, Any]:
    config = request.config
    with devices.held(config.devices, control) as names:  # waits while another launch holds the devices
        control.queued = False
        plan = _Plan(request, control, names)
        plan.check()
        with launch_directory() as directory, contextlib.ExitStack() as held:
            held.enter_context(log_dir_held(config.log_dir if plan.nodes is None else None))  # (nodes share one)
            spec = held.enter_context(plan.spec_written(directory))
            with preemption_notice(control, directory, config.preempt_signals, config.preempt_grace) as notice:
                if plan.nodes is not None:
                    results = plan.on_nodes(spec, notice)
                else:
                    attempts = run_attempts(
                        lambda restart: plan.attempt(spec, restart, notice),
                        config.max_restarts,
                        control,
                        config.restart_on,
                        config.restart_delay,
                    )
                    results = yield from attempts
    return results if config.return_all else results[0]


class _Plan:
    """One launch's resolved options (ranks, nodes, start method, state, payload) and its steps."""

    def __init__(self, request: CallRequest, control: LaunchControl, names: list[str] | None) -> None:
        config = self.config = request.config
        self.request, self.function, self.control, self.names = request, request.function, control, names
        self.streams = request.streams
        auto = names is not None and config.nprocs == "auto"
        self.nprocs = len(names) if names is not None and auto else policy.resolve_nprocs(config.nprocs)
        self.nodes: NodeSetup | None = node_setup(config.nnodes, config.node_rank, config.rdzv_endpoint)
        self.start_method = config.start_method or policy.default_start_method()
        self.forked = self.start_method == "fork" and self.nodes is None  # workers inherit the state as it is
        self.imports = None if self.forked else worker_imports()

    def check(self) -> None:
        """Run the checks that depend on the resolved options; capture the payload."""
        config, nodes = self.config, self.nodes
        if nodes is not None:
            check_mode(config, "multi-node", f"a launch on nnodes={nodes.nnodes}")
            if self.streams:
                raise InvalidOptionError(
                    f"a generator function runs on one node, and this launch has nnodes={nodes.nnodes} (from "
                    "MPLAUNCH_NNODES or SLURM's variables): "
                    f"{refused_in('generator function')['nnodes']}, or run it on one node."
                )
        checks.check_cuda_fork(self.start_method)
        check_console_ranks(config, self.nprocs * (nodes.nnodes if nodes else 1), "this launch")
        state = captured_state(self.forked, self.control.state)
        function = _function_reference(self.function, self.imports)
        self.payload = Payload(function, self.request.args, self.request.kwargs, state)

    @contextlib.contextmanager
    def spec_written(self, directory: str) -> Iterator[LaunchSpec]:
        """Yield the launch's spec, with the payload written for workers that cannot inherit it, and its board."""
        config, nodes, payload = self.config, self.nodes, self.payload
        with contextlib.ExitStack() as held:
            written = Written()
            if not self.forked:
                one = nodes is None  # on one node: to a memory file, the user's shared storages kept shared
                call = payload_written(payload, directory, self.start_method, self.imports, memory=one, keep_shared=one)
                written = held.enter_context(call)
            wanted = nodes is None and (
                config.stall_timeout is not None or self.start_method != "fork" or sigchld_handled()
            )
            self.board = held.enter_context(board_for(directory, self.nprocs, wanted))
            yield launch_spec(
                config,
                directory,
                self.nprocs,
                self.start_method,
                self.names,
                nodes=nodes,
                stacks=config.timeout is not None or config.stall_timeout is not None or self.control.stacks_wanted,
                board=self.board is not None,
                payload=written,
            )

    def on_nodes(self, spec: LaunchSpec, notice: Preemption) -> list[Any]:
        """Run this node's share of a multi-node launch (torch elastic runs its ranks)."""
        from mplaunch._parent.nodes.elastic import launch_nodes

        assert self.nodes is not None
        if self.start_method == "forkserver":
            short_socket_directory()  # elastic starts the fork server
        return launch_nodes(spec, self.nodes, self.config, notice)

    def attempt(
        self, spec: LaunchSpec, restart: int, notice: Preemption
    ) -> Generator[tuple[int, Any], None, list[Any]]:
        """Run one attempt of a one-node launch, with a fresh store; none once preempted (e.g. waiting to restart)."""
        control, config = self.control, self.config
        control.restarts = restart
        if notice.noticed:
            raise notice.error({}, 0)
        if restart:  # the earlier attempt's outcomes, dumps and beats go (a first one's directory is new, and empty)
            for rank in range(spec.nprocs):
                transport.remove(spec.directory, outcome_name(rank))
                stacks.forget(spec.directory, rank)  # the new worker is asked for stacks only once it can dump
            if self.board is not None:
                self.board.clear()
        within = config.timeout if control.deadline is None else control.remaining()
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(rendezvous(resolve_within=within))
            ranks = new_ranks(stack, spec, store, self.board, restart)
            stack.callback(self._closed, ranks)
            pipes = [multiprocessing.Pipe(duplex=False) for _ in range(spec.nprocs)] if self.streams else []
            ranks.start(run, self.payload if self.forked else None, _preload(self.imports, self.function), pipes)
            if self.streams and restart == 0:
                yield STARTED
            states = yield from ranks.call(0, control, config.timeout, config.stall_timeout)
            return values(states, spec.nprocs)

    def _closed(self, ranks: Ranks) -> None:
        """Stop and let go of the attempt's ranks; keep their report."""
        try:
            ranks.stop()
            self.control.ranks = ranks.report()
        finally:
            ranks.close()


def launch_spec(
    config: ParallelConfig,
    directory: str,
    nprocs: int,
    start_method: str,
    names: list[str] | None,
    *,
    nodes: NodeSetup | None = None,
    stacks: bool = True,
    board: bool = False,
    payload: Written | None = None,
) -> LaunchSpec:
    """Build the spec of a launch or of warm workers (the one builder); ``payload``: where the call was written."""
    wanted_threads = policy.wanted_threads(nprocs)  # read once: the cgroup's CPU quota is four files
    num_threads = policy.worker_threads(nprocs, start_method, wanted_threads)
    multinode = nodes is not None
    world_size = nprocs * (nodes.nnodes if nodes else 1)
    backend = policy.resolve_backend(config.backend, nprocs, None if names is None else len(names))
    if backend == "nccl" and not devices.device_count():
        raise LaunchRefusedError("backend='nccl' needs CUDA devices and this machine has none: use 'gloo'.")
    threads_kept = "OMP_NUM_THREADS" not in os.environ and num_threads >= wanted_threads
    placements = placement.plan(config, nprocs, names, multinode=multinode, threads_kept=threads_kept)
    placement.check_fork_env(placements, start_method)
    return LaunchSpec(
        directory=directory,
        nprocs=nprocs,
        start_method=start_method,
        parent_pid=os.getpid(),
        num_threads=num_threads,
        reporting_ranks=frozenset(range(world_size)) if config.return_all else frozenset({0}),
        environ=dict(os.environ) if start_method == "forkserver" and not multinode else None,
        backend=backend,
        prefix_output=config.prefix_output,
        console_ranks=config.console_ranks,
        log_dir=config.log_dir,
        grace_period=config.grace_period,
        mp_start_method=multiprocessing.get_start_method(allow_none=True),
        ignored_signals=ignored_signals(),
        own_group=own_group(),
        placements=placements,
        env_function=placement.env_function(config, start_method) if multinode else None,
        post_mortem=checks.post_mortem_terminal(config.post_mortem),
        stacks=stacks,
        board=board,
        max_restarts=config.max_restarts,
        seed=config.seed,
        result_wait=config.timeout if config.timeout is not None else config.rdzv_timeout,
        payload_fd=None if payload is None else payload.fd,
        start_objects=() if payload is None else payload.start_objects,
    )


def attempt_spec(store: Any, restart: int, output_fds: tuple[RankFds, ...] | None) -> AttemptSpec:
    """Build the spec of one start of the ranks: where they meet, which attempt, what replaces fd 1 and 2."""
    return AttemptSpec(
        master_addr=store.addr,
        master_port=store.port,
        agent_store=store.agent_store,
        restart_count=restart,
        output_fds=output_fds,
    )


def new_ranks(
    stack: contextlib.ExitStack,
    spec: LaunchSpec,
    store: Rendezvous,
    board: Board | None,
    restart: int = 0,
    warm: bool = False,
) -> Ranks:
    """Make the :class:`Ranks` of one start, their outcome files and output pump held by ``stack``."""
    outcome_fds = stack.enter_context(outcome_files(spec.nprocs))
    pump = stack.enter_context(routed(list(range(spec.nprocs)), spec, restart))
    attempt = attempt_spec(store, restart, worker_fds(pump, spec.start_method, spec.nprocs))
    return Ranks(spec, attempt, store, outcome_fds=outcome_fds, warm=warm, board=board, pump=pump)


def check_console_ranks(config: ParallelConfig, world_size: int, whose: str) -> None:
    """Refuse ``console_ranks`` that name no rank of ``world_size``."""
    if config.console_ranks is not None and not any(rank < world_size for rank in config.console_ranks):
        raise InvalidOptionError(
            f"console_ranks={sorted(config.console_ranks)} names no rank of {whose} (ranks 0 to "
            f"{world_size - 1}), so no output would reach the console: pick ranks below {world_size}."
        )


def captured_state(forked: bool, state: GlobalState | None = None) -> ForkState | GlobalState:
    """Capture the parent's state for the ranks (``state``: already captured); warn of what a spawn loses."""
    found = state or (for_launch(ForkState.capture()) if forked else for_launch(GlobalState.capture()))
    if isinstance(found, GlobalState) and found.python is not None and not forked:
        warn_not_carried(found.python)
    return found


def _function_reference(function: Any, imports: WorkerImports | None) -> Any:
    """Pick the function to send: the decorated one if a worker can import it by name, else its original, else plain."""
    if imports is not None:
        if imports.can_import(function):
            return function
        original = named_original(function)
        if original is not None and imports.can_import(original):
            return original
    return function._mplaunch_target


def _preload(imports: WorkerImports | None, function: Any) -> list[str]:
    """List the modules the fork server imports once at its start, so its workers do not (the function's, if it can)."""
    modules = ["__main__", "torch", "mplaunch._worker.entry"]
    if "numpy" in sys.modules:
        modules.append("numpy.random")  # imported lazily by NumPy 2; restoring its state would import it
    module = getattr(function, "__module__", None)
    if imports is not None and module and module != "__main__" and imports.module_importable(module):
        modules.append(module)
    modules.append("mplaunch._worker.forkserver_freeze")  # last: what the server imported is then left to it
    return modules
