"""What runs first in a worker process, before and after the user's function."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mplaunch import _transport
from mplaunch._env import apply_environment, rank_environment
from mplaunch._output import rank_output
from mplaunch._sharing import to_cpu, unshare
from mplaunch._state import GlobalState

PAYLOAD = "payload"
REMOTE_RANK0 = "remote-rank0"  # rank 0's outcome, fetched by a node that does not run rank 0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker of one launch needs to know; small, so starting a worker sends little."""

    directory: str
    nprocs: int
    start_method: str
    parent_pid: int
    master_addr: str
    master_port: int
    agent_store: bool
    num_threads: int
    reporting_ranks: frozenset[int]
    environ: dict[str, str] | None  # the parent's environment, for forkserver workers (they inherit the server's)
    backend: str | None = None
    prefix_output: bool = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    restart_count: int = 0
    max_restarts: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Payload:
    """The function, its arguments and the parent's state; under fork it is inherited, else read from a file."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: GlobalState


def outcome_name(rank: int) -> str:
    """The name under which rank ``rank`` writes its outcome in the launch directory."""
    return f"rank{rank}"


@functools.lru_cache(maxsize=1)
def _prctl() -> Any:
    """libc's prctl, loaded once (in the parent before a fork, so forked workers inherit it)."""
    return ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent_pid: int, start_method: str) -> None:
    """Make sure this worker dies when the launching process dies, even by SIGKILL; exit now if it is gone.

    Under fork and spawn the launching process is the parent: Linux's ``PR_SET_PDEATHSIG`` sends SIGKILL.
    Under forkserver the parent is the fork server, which outlives a killed launcher (its children keep the
    server's "alive" pipe open), so a daemon thread waits on a pidfd of the launching process instead.
    """
    if not sys.platform.startswith("linux"):
        return
    if start_method != "forkserver":
        try:
            _prctl()(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
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
    """Raised in a worker by the SIGTERM with which the launch stops it (distinct from the user's SystemExit)."""


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise Terminated(128 + signum)


def _set_threads(num_threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


@contextlib.contextmanager
def process_group(backend: str | None, rank: int) -> Iterator[None]:
    """Initialise the default process group from the torchrun environment around the function."""
    if backend is None:
        yield
        return
    import torch.distributed as dist

    if backend == "nccl":
        if torch.cuda.device_count() == 0:
            raise RuntimeError("backend='nccl' needs CUDA devices, and this worker sees none; use backend='gloo'")
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _safely(describe: Callable[[BaseException], str], error: BaseException) -> str:
    try:
        return describe(error)
    except Exception as failure:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"<{type(error).__qualname__}: {describe.__name__}() failed with {type(failure).__name__}>"


def _error_outcome(error: BaseException) -> dict[str, Any]:
    try:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    except Exception:  # noqa: BLE001
        text = "".join(traceback.format_tb(error.__traceback__)) + _safely(repr, error)
    try:
        exc_bytes = _pickle_exception(error)
    except Exception:  # noqa: BLE001 - an exception that cannot be pickled travels as text
        exc_bytes = None
    return {
        "ok": False,
        "pid": os.getpid(),
        "exception": exc_bytes,
        "type_name": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": _safely(str, error),
        "repr": _safely(repr, error),
        "traceback": text,
    }


def _pickle_exception(error: BaseException) -> bytes:
    import pickle

    import cloudpickle

    traceback_, cause, context = error.__traceback__, error.__cause__, error.__context__
    try:
        error.__traceback__ = None
        try:
            return pickle.dumps(error)
        except Exception:  # noqa: BLE001
            data: bytes = cloudpickle.dumps(error)
            return data
    finally:
        error.__traceback__, error.__cause__, error.__context__ = traceback_, cause, context


def _write_outcome(spec: WorkerSpec, rank: int, outcome: dict[str, Any]) -> dict[str, Any]:
    """Write the outcome; a result that cannot be pickled is replaced by the error saying so. Returns what
    was written."""
    try:
        _transport.dump(outcome, spec.directory, outcome_name(rank))
        return outcome
    except Exception as error:  # noqa: BLE001 - the result cannot be sent: report that instead
        _transport.remove(spec.directory, outcome_name(rank))
        if not outcome["ok"]:
            raise
        value = outcome["value"]
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        failure: Exception
        if isinstance(error, OSError):
            failure = OSError(
                error.errno,
                f"the result of rank {rank} (type {kind}) could not be written to {spec.directory} for the parent: "
                f"{error.strerror}. Make room there (e.g. docker run --shm-size=8g) or set MPLAUNCH_SHM_DIR.",
            )
        else:
            failure = TypeError(
                f"the result of rank {rank} (type {kind}) cannot be pickled to send it to the parent: {error}"
            )
        failure.__cause__ = error
        replacement = _error_outcome(failure)
        _transport.dump(replacement, spec.directory, outcome_name(rank))
        return replacement


def _execute(rank: int, local_rank: int, spec: WorkerSpec, payload: Payload | None) -> dict[str, Any]:
    """Restore the parent's state, run the function with private arguments, and return the outcome."""
    try:
        _set_threads(spec.num_threads)
        if payload is None:
            payload = _transport.load(spec.directory, PAYLOAD, private=True, remove=False)
        payload.state.restore()
        function = getattr(payload.function, "_mplaunch_target", payload.function)
        args, kwargs = payload.args, payload.kwargs
        if spec.start_method == "fork":  # inherited: shared memory stays shared; else mapped private already
            args, kwargs = unshare((args, kwargs))
        with rank_output(rank, spec.prefix_output, spec.console_ranks, spec.log_dir):
            with process_group(spec.backend, local_rank):
                value = function(*args, **kwargs)
        if rank not in spec.reporting_ranks:
            value = None
        elif torch.cuda.is_initialized():
            value = to_cpu(value)
        return {"ok": True, "pid": os.getpid(), "value": value}
    except BaseException as error:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        return _error_outcome(error)


def _finish(failed: bool) -> None:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if failed:
        os._exit(1)


def _start(spec: WorkerSpec) -> None:
    """Signals, parent-death and exit handlers: the first things a worker does."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked while starting
    _die_with_parent(spec.parent_pid, spec.start_method)
    if spec.start_method != "spawn":
        atexit._clear()  # inherited from the parent or the fork server: not ours to run
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a process group of its own: stopping the worker stops what it started too


def run(rank: int, spec: WorkerSpec, payload: Payload | None) -> None:
    """The target of every worker process: set up the rank, run the function, write the outcome.

    The outcome (the return value for reporting ranks, ``None`` for the others, or the exception) is written
    to the launch directory before the process exits; the parent reads it when it sees the process end.
    """
    _start(spec)
    if spec.environ is not None:
        os.environ.clear()
        os.environ.update(spec.environ)
    apply_environment(
        os.environ,
        rank_environment(
            rank,
            spec.nprocs,
            spec.master_addr,
            spec.master_port,
            agent_store=spec.agent_store,
            restart_count=spec.restart_count,
            max_restarts=spec.max_restarts,
        ),
    )
    outcome = {"ok": False}
    try:
        outcome = _execute(rank, rank, spec, payload)
        _write_outcome(spec, rank, outcome)
    finally:
        _finish(not outcome["ok"])
    os._exit(0)  # done: threads the function left running must not keep the worker (and the call) alive


def elastic_entry(spec: WorkerSpec) -> int:
    """The entrypoint of a worker started by ``torch.distributed.elastic`` on one node of a multi-node launch.

    Elastic has set the torchrun environment. The outcome is written to this node's launch directory; rank
    0's is also published in the rendezvous store, where the first worker of every other node fetches it,
    so every node's parent can return rank 0's result. Returns the global rank.
    """
    _start(spec)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    outcome = {"ok": False}
    try:
        outcome = _write_outcome(spec, rank, _execute(rank, local_rank, spec, None))
        _share_rank0(spec, rank, local_rank, outcome)
    finally:
        _finish(not outcome["ok"])
    return rank


def _share_rank0(spec: WorkerSpec, rank: int, local_rank: int, outcome: dict[str, Any]) -> None:
    """Rank 0 publishes its outcome in the rendezvous store; the first worker of each other node fetches it."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    on_first_node = os.environ.get("GROUP_RANK", "0") == "0"
    if rank != 0 and (on_first_node or local_rank != 0 or not outcome["ok"]):
        return  # a failed worker does not wait for rank 0: its own failure is what this node reports
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(hours=24)
    )
    key = f"mplaunch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank0"
    if rank == 0:
        store.set(key, _transport.to_bytes(outcome))  # type: ignore[arg-type]
    else:
        _transport.dump(_transport.from_bytes(store.get(key)), spec.directory, REMOTE_RANK0)
