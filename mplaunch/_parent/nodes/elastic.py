"""Multi-node launches, run by ``torch.distributed.elastic``'s agent (torchrun's engine), plus rank 0's result on every
node, the original exception, the caller's state kept and (:mod:`.handler`) ``timeout`` and lost nodes named."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mplaunch._config import ParallelConfig
from mplaunch._env import NodeSetup
from mplaunch._errors import LaunchTimeoutError, NodeLostError, set_attribute
from mplaunch._frames import warn_at_user
from mplaunch._output.pump import routed, worker_fds
from mplaunch._parent.nodes import handler, notice
from mplaunch._parent.outcomes import exit_error, rank_state
from mplaunch._parent.restarts import RestartWarning, describe_restart
from mplaunch._platform.environ import environ_kept
from mplaunch._wire import transport
from mplaunch._wire.records import REMOTE_RANK0, Outcome, Raised, Returned, outcome_name, outcome_rank
from mplaunch._wire.spec import AttemptSpec, LaunchSpec, WorkerSpec
from mplaunch._worker.elastic import elastic_entry

if TYPE_CHECKING:
    from mplaunch._parent.preemption import Preemption

#: The signals elastic's agent turns into its own stop (``LaunchConfig.signals_to_handle``'s default).
_ELASTIC_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: The handlers put back after elastic: its own signals, and SIGUSR2 (handed to it when it would get none).
_HANDLED = (*_ELASTIC_SIGNALS, signal.SIGUSR2)


@contextlib.contextmanager
def _caller_state_kept() -> Iterator[None]:
    """Put back the signal handlers (main thread only, as elastic) and environment variables elastic changes."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {signum: signal.getsignal(signum) for signum in _HANDLED} if main else {}
    try:
        with environ_kept():
            yield
    finally:
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)


def _signals_to_handle(preempt_signals: tuple[int, ...]) -> str:
    """Return elastic's ``signals_to_handle``: its own less ``preempt_signals``, else SIGUSR2 (never none)."""
    names = [signal.Signals(signum).name for signum in _ELASTIC_SIGNALS if signum not in preempt_signals]
    if not names and signal.SIGUSR2 not in preempt_signals:
        names = ["SIGUSR2"]
    return ",".join(names)


def _shutdown_timeout(grace_period: float) -> dict[str, Any]:
    """Return ``grace_period`` as elastic's ``shutdown_timeout`` (whole seconds), where this torch takes it."""
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {field.name for field in dataclasses.fields(LaunchConfig)}:
        return {}
    return {"shutdown_timeout": max(1, math.ceil(grace_period))}


def launch_nodes(
    spec: LaunchSpec, nodes: NodeSetup, config: ParallelConfig, preemption: Preemption | None = None
) -> list[Any]:
    """Run this node's share of a multi-node launch; return rank 0's value (``return_all``: this node's ranks'); raise
    PreemptedError once ``preemption`` is noticed; earlier attempts' failures go in ``earlier_attempts``."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    handler.register()
    told = preemption if preemption is not None and preemption.attached else None
    node_watch = handler.NodeWatch(nodes.rdzv_endpoint, nodes.nnodes, config.timeout, preemption=told)
    node_watch.directory, node_watch.max_restarts = spec.directory, config.max_restarts
    earlier: list[BaseException] = []  # the failures that ended earlier attempts
    node_watch.on_restart = lambda: _restarted(spec, node_watch, earlier)
    elastic_config = ElasticConfig(
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=spec.nprocs,
        run_id=nodes.run_id,
        role="mplaunch",
        rdzv_endpoint=nodes.rdzv_endpoint,
        rdzv_backend=handler.BACKEND,
        rdzv_configs=handler.rendezvous_configs(node_watch, config.rdzv_timeout),
        max_restarts=config.max_restarts,
        monitor_interval=0.1,
        start_method=spec.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(spec.directory, "elastic")),
        signals_to_handle=_signals_to_handle(config.preempt_signals),
        **_shutdown_timeout(config.grace_period),
    )
    try:
        failed: dict[int, Any] = {}
        exchanged = (
            notice.notices_exchanged(told, nodes.rdzv_endpoint, nodes.run_id, lambda: node_watch.node_rank)
            if told is not None
            else contextlib.nullcontext()
        )
        # ranks: as the rendezvous assigns
        with _caller_state_kept(), exchanged, routed([None] * spec.nprocs, spec) as pump:
            worker = WorkerSpec(spec, AttemptSpec(output_fds=worker_fds(pump, spec.start_method, spec.nprocs)))
            if pump is not None:
                pump.start(keep_writers=True)  # elastic may restart workers on the same pipes
            try:
                with node_watch.guarded():
                    elastic_launch(elastic_config, elastic_entry)(worker)
            except notice.Preempted:  # the grace is over: the agent stopped this node's ranks
                _leave_barrier(node_watch)
            except Exception as error:  # noqa: BLE001 - _ended raises all but the failed workers
                failed = _ended(error, node_watch, config, told)
        if told is not None and told.noticed:
            raise _preempted(spec, told, node_watch.node_rank)
        try:
            return _collect(spec, failed, config.return_all)
        except NodeLostError as error:  # rank 0's result never came: name its node if the store says who it was
            if node_watch.store_lost is None:
                raise
            raise node_watch.store_error(node_watch.store_lost) from error
        except Exception as error:  # a rank failed: in a collective with a rank of a lost node?
            lost = node_watch.lost_peer() if failed and node_watch.lost_peer is not None else None
            if lost is None:
                raise
            raise lost from error
    except Exception as error:
        set_attribute(error, "earlier_attempts", tuple(earlier))
        raise


def _ended(
    error: Exception, watch: handler.NodeWatch, config: ParallelConfig, told: Preemption | None
) -> dict[int, Any]:
    """Raise what ended this node's launch early, else return the failed workers, whose failure ends it."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

    if not isinstance(error, NodeLostError):  # past timeout: torch raised as its calls were cut
        watch.check_deadline()
    store = isinstance(error, (RendezvousError, DistError))  # torch's store fails with either
    if isinstance(error, ChildFailedError) and told is not None and told.noticed:  # failed while saving: preempted
        _leave_barrier(watch)
    elif watch.store_lost is not None or (store and watch.joined and not isinstance(error, RendezvousTimeoutError)):
        raise watch.store_error(watch.store_lost or error) from error  # (a rendezvous timeout: no node rejoined)
    if isinstance(error, ChildFailedError):
        return dict(error.failures)
    if store:
        raise LaunchTimeoutError(
            f"not all {watch.nnodes} nodes joined the rendezvous at {watch.endpoint} within "
            f"rdzv_timeout={config.rdzv_timeout:g} s ({type(error).__name__}: {error}). Start the call on every "
            "node with the same rdzv_endpoint, or raise rdzv_timeout.",
            config.rdzv_timeout,
            (),
        ) from error
    raise error


def _restarted(spec: LaunchSpec, watch: handler.NodeWatch, earlier: list[BaseException]) -> None:
    """Keep and announce the failure that ended this node's attempt (the node lost, else its first rank's)."""
    failure: BaseException | None
    failure, watch.lost_node = watch.lost_node, None
    try:
        _collect(spec, {}, return_all=True)  # (the attempt's outcomes are read and removed)
    except Exception as error:  # noqa: BLE001 - the attempt's failure, kept
        failure = failure or error
    if failure is not None:
        earlier.append(failure)
        warn_at_user(describe_restart(failure, len(earlier), watch.max_restarts), RestartWarning)


def _collect(spec: LaunchSpec, failed: dict[int, Any], return_all: bool) -> list[Any]:
    """Raise this node's first failure in time (else lowest rank), else rank 0's; else return the values."""
    ranks = sorted(r for r in map(outcome_rank, os.listdir(spec.directory)) if r is not None)
    outcomes: dict[int, Outcome] = {
        rank: transport.load(spec.directory, outcome_name(rank), private=False, remove=True) for rank in ranks
    }
    raised = sorted((o.when, rank) for rank, o in outcomes.items() if isinstance(o, Raised))  # first in time
    others = sorted(set(failed) | {rank for rank, o in outcomes.items() if not isinstance(o, Returned)})
    for rank in [rank for _, rank in raised] or others:
        outcome = outcomes.get(rank)
        state = rank_state(rank, outcome, None, None, stopped=False)
        if outcome is None:
            failure = failed[rank]
            state = exit_error(rank, failure.pid, failure.exitcode, None)
        if isinstance(state, BaseException):
            raise state
    if return_all:
        return [_value(outcomes[rank]) for rank in sorted(outcomes)]
    rank0 = outcomes.get(0) or transport.load(spec.directory, REMOTE_RANK0, private=False, remove=True)
    state = rank_state(0, rank0, None, None, stopped=False)
    if isinstance(state, BaseException):
        raise state
    return [_value(rank0)]


def _leave_barrier(node_watch: handler.NodeWatch) -> None:
    if node_watch.leave_barrier is not None:
        node_watch.leave_barrier()


def _preempted(spec: LaunchSpec, preemption: Preemption, node_rank: int) -> BaseException:
    """Return this node's :class:`~mplaunch.PreemptedError`."""
    ranks = range(node_rank * spec.nprocs, (node_rank + 1) * spec.nprocs) if node_rank >= 0 else range(0)
    states = {}
    for rank in sorted(r for r in map(outcome_rank, os.listdir(spec.directory)) if r is not None):
        outcome = transport.load(spec.directory, outcome_name(rank), private=False, remove=True)
        states[rank] = rank_state(rank, outcome, None, None, stopped=not isinstance(outcome, Raised))
    return preemption.error(states, spec.nprocs, ranks)


def _value(outcome: Outcome) -> Any:
    return outcome.value if isinstance(outcome, Returned) else None
