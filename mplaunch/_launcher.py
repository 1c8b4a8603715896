"""The one module that starts, watches and stops worker processes."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import torch
import torch.multiprocessing as mp

from mplaunch import _checks, _transport
from mplaunch._config import LaunchConfig, resolve_backend, resolve_nprocs, usable_cpu_count
from mplaunch._control import LaunchControl
from mplaunch._env import DEFAULT_MASTER_ADDR, OWN_PORT_VARIABLE, NodeSetup, node_setup, outer_launcher
from mplaunch._errors import (
    InvalidOptionError,
    LaunchRefusedError,
)
from mplaunch._restarts import run_attempts
from mplaunch._state import GlobalState
from mplaunch._supervisor import Supervisor
from mplaunch._worker import PAYLOAD, Payload, WorkerSpec, _prctl, outcome_name, run

_DIR_PREFIX = "mplaunch-"
_BASELINE_NATIVE_THREADS = min(_checks.native_thread_count(), 1)
_warned_fork_threads = False


class _ParentTerminated(BaseException):
    """Raised in the parent by SIGTERM during a launch, to unwind and stop the workers first."""


def _shm_root() -> str:
    """Where launch directories go: ``MPLAUNCH_SHM_DIR`` if set, else /dev/shm, else the temp dir."""
    configured = os.environ.get("MPLAUNCH_SHM_DIR")
    if configured:
        return configured
    root = "/dev/shm"
    if os.path.isdir(root) and os.access(root, os.W_OK):
        return root
    return tempfile.gettempdir()


def _pid_namespace() -> str:
    """This process's pid namespace, so that directories of another namespace sharing /dev/shm (e.g. a
    container with --ipc=host) are never judged by pids of this one."""
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def _remove_stale_directories(root: str) -> None:
    """Remove launch directories left by parents that were killed (their pid no longer exists)."""
    namespace = _pid_namespace()
    for entry in os.listdir(root):
        if not entry.startswith(_DIR_PREFIX):
            continue
        pid, _, rest = entry[len(_DIR_PREFIX) :].partition("-")
        if pid.isdigit() and rest.startswith(f"{namespace}-") and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _launch_directory() -> Iterator[str]:
    root = _shm_root()
    _remove_stale_directories(root)
    directory = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-{_pid_namespace()}-", dir=root)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _rendezvous() -> Iterator[tuple[str, int, bool]]:
    """Yield ``(MASTER_ADDR, MASTER_PORT, agent_store)``.

    Unless the user set ``MASTER_PORT``, the parent hosts the c10d TCPStore itself on a port the OS assigns
    (port 0) and holds it for the whole launch, as torchrun's agent does: no "free port" is picked and
    released, so concurrent launches cannot collide.
    """
    own_port = os.environ.get(OWN_PORT_VARIABLE)
    port = os.environ.get("MASTER_PORT")
    if port and port == own_port:  # inherited from the launch this process is a worker of: not the user's
        port = None
    addr = (os.environ.get("MASTER_ADDR") if own_port is None else None) or DEFAULT_MASTER_ADDR
    if port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchRefusedError(f"MASTER_PORT={port!r} is not a TCP port: set it to 1-65535, or unset it.")
        yield addr, int(port), False
        return
    if not torch.distributed.is_available():
        import socket

        with socket.socket() as sock:
            sock.bind((addr, 0))
            free_port = sock.getsockname()[1]
        yield addr, free_port, False
        return
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except RuntimeError as error:  # DistNetworkError and friends
        raise LaunchRefusedError(
            f"cannot host the rendezvous store for MASTER_ADDR={addr!r}: {error}. Set MASTER_ADDR to an address "
            "of this machine (127.0.0.1 by default), or unset it."
        ) from error
    try:
        yield addr, store.port, True
    finally:
        del store


@contextlib.contextmanager
def _parent_signals() -> Iterator[None]:
    """During the launch, let SIGTERM unwind the parent (so workers are stopped); restore handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        yield
        return

    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked worker that has not yet installed its own handler
            raise SystemExit(128 + signum)
        raise _ParentTerminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _ParentTerminated:
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)
            raise KeyboardInterrupt("SIGTERM received during a launch") from None
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: die by SIGTERM, as asked
        raise KeyboardInterrupt("SIGTERM received during a launch") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM while workers start. A forked child inherits the mask, so a signal sent to it
    before it has installed its own handlers waits instead of unwinding the parent's stack copied into it;
    the worker unblocks them first thing. Signals sent to the parent meanwhile are delivered on exit."""
    blocked = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _main_without_file() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that is no real file (``python -`` sets ``<stdin>``): multiprocessing's
    spawn would try to run it in the child and fail before our code runs."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _num_threads(nprocs: int, start_method: str) -> int:
    """Intra-op threads per worker: the user's ``OMP_NUM_THREADS`` if set, else cores // nprocs; one thread
    in forked workers when this process's OpenMP pool is already running (GNU OpenMP hangs after fork)."""
    global _warned_fork_threads
    user = os.environ.get("OMP_NUM_THREADS")
    wanted = max(1, int(user)) if user and user.isdigit() else max(1, usable_cpu_count() // nprocs)
    pool_live = start_method == "fork" and _checks.native_thread_count() > _BASELINE_NATIVE_THREADS
    if pool_live and wanted > 1:
        if not _warned_fork_threads:
            _warned_fork_threads = True
            warnings.warn(
                "mplaunch: this process already ran multi-threaded torch operations, and GNU OpenMP's thread "
                "pool does not survive fork, so forked workers use 1 intra-op thread each (else they would "
                f"hang). Use start_method='forkserver' or 'spawn' for {wanted} threads per worker.",
                RuntimeWarning,
                stacklevel=4,
            )
        return 1
    return wanted


def _function_reference(function: Any, by_value: bool) -> Any:
    """What to send as the function: the decorated object when a worker can import it by name, else the
    plain function (pickled by reference where possible, by value otherwise)."""
    wrapped = function._mplaunch_target
    qualname = getattr(function, "__qualname__", None)
    if by_value or qualname is None:  # e.g. a functools.partial or a callable object
        return wrapped
    module = sys.modules.get(getattr(function, "__module__", ""))
    holder: Any = module
    for part in qualname.split("."):
        holder = getattr(holder, part, None)
    return function if holder is function else wrapped


def launch(
    function: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: LaunchConfig,
    frame: Any,
    control: LaunchControl | None = None,
) -> Any:
    """Run ``function`` (a ``ParallelFunction``) on ``config.nprocs`` workers and return its result(s);
    ``control`` (a submitted launch's) can stop it."""
    _checks.check_not_bootstrapping()
    try:
        outer = outer_launcher()
    except ValueError as error:
        raise InvalidOptionError(str(error)) from None
    if outer is not None:
        return _run_in_process(function, args, kwargs, config)
    with _parent_signals():  # outermost: a SIGTERM unwinds through the clean-ups below before it ends us
        return _launch(function, args, kwargs, config, frame, control or LaunchControl())


def check_call(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: LaunchConfig, frame: Any) -> bool:
    """Run, in the caller's thread, the checks of a call that depend on where it was made (the main guard
    looks at the caller's current line); return whether the call will start workers (else it runs in-process)."""
    _checks.check_not_bootstrapping()
    try:
        if outer_launcher() is not None:
            return False
    except ValueError as error:
        raise InvalidOptionError(str(error)) from None
    _check_arguments(function, args, kwargs)
    _checks.check_main_guard(config.start_method or _checks.default_start_method(), frame)
    return True


def _check_arguments(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise the ``TypeError`` a plain call would raise for wrong arguments, here, before any worker starts."""
    target = function._mplaunch_target
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins and other callables without a signature
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(target, "__qualname__", repr(target))
        raise TypeError(f"{name}(): {error} (checked before launching any worker)") from None


def _launch(
    function: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: LaunchConfig,
    frame: Any,
    control: LaunchControl,
) -> Any:
    _check_arguments(function, args, kwargs)
    nprocs = resolve_nprocs(config.nprocs)
    nodes = _nodes(config)
    start_method = config.start_method or _checks.default_start_method()
    _checks.check_cuda_fork(start_method)
    _checks.check_main_guard(start_method, frame)
    by_value = start_method != "fork" and (
        not _checks.main_is_importable() or _checks.defined_in_main_guard(function._mplaunch_target)
    )
    world_size = nprocs * (nodes.nnodes if nodes else 1)
    if config.console_ranks is not None and not any(rank < world_size for rank in config.console_ranks):
        raise InvalidOptionError(
            f"console_ranks={sorted(config.console_ranks)} names no rank of this launch (ranks 0 to "
            f"{world_size - 1}), so no output would reach the console: pick ranks below {world_size}."
        )
    state = control.state if control.state is not None else GlobalState.capture()
    payload = Payload(_function_reference(function, by_value), args, kwargs, state)
    if start_method == "fork":
        import lightning_utilities  # noqa: F401 - imported once here rather than in every forked worker

        _prctl()

    with _launch_directory() as directory:
        spec = WorkerSpec(
            directory=directory,
            nprocs=nprocs,
            start_method=start_method,
            parent_pid=os.getpid(),
            master_addr="",
            master_port=0,
            agent_store=True,
            num_threads=_num_threads(nprocs, start_method),
            reporting_ranks=frozenset(range(world_size)) if config.return_all else frozenset({0}),
            environ=dict(os.environ) if start_method == "forkserver" and nodes is None else None,
            backend=resolve_backend(config.backend, nprocs),
            prefix_output=config.prefix_output,
            console_ranks=config.console_ranks,
            log_dir=config.log_dir,
        )
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise LaunchRefusedError("backend='nccl' needs CUDA devices and this machine has none: use 'gloo'.")
        if start_method != "fork" or nodes is not None:
            _write_payload(payload, spec, by_value)
        if nodes is not None:
            from mplaunch._elastic import launch_nodes

            results = launch_nodes(spec, nodes, config)
        else:
            in_memory = payload if start_method == "fork" else None
            module = getattr(function, "__module__", None)
            results = run_attempts(
                lambda restart: _attempt(spec, in_memory, config, module, control, restart),
                config.max_restarts,
                control,
            )
    return results if config.return_all else results[0]


def _attempt(
    spec: WorkerSpec,
    payload: Payload | None,
    config: LaunchConfig,
    module: str | None,
    control: LaunchControl,
    restart: int,
) -> list[Any]:
    """One attempt of a one-node launch: a fresh rendezvous store, no outcome left by an earlier attempt."""
    for rank in range(spec.nprocs):
        _transport.remove(spec.directory, outcome_name(rank))
    with _rendezvous() as (addr, port, agent_store):
        spec = dataclasses.replace(
            spec,
            master_addr=addr,
            master_port=port,
            agent_store=agent_store,
            restart_count=restart,
            max_restarts=config.max_restarts,
        )
        return _run_workers(spec, payload, config, module, control)


def _space_hint(directory: str) -> str:
    """Say how much room the shared-memory file system has, and how to get more."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return ""
    free, total = stats.f_bavail * stats.f_frsize / 2**20, stats.f_blocks * stats.f_frsize / 2**20
    return (
        f"It has {free:.0f} MiB free of {total:.0f} MiB; mplaunch needs room there for the arguments and results "
        "(e.g. docker run --shm-size=8g), or set MPLAUNCH_SHM_DIR to a larger directory."
    )


def _write_payload(payload: Payload, spec: WorkerSpec, by_value: bool) -> None:
    """Write the call for workers that cannot inherit it; refuse, naming the argument, what cannot be pickled."""
    try:
        _transport.dump(payload, spec.directory, PAYLOAD, by_value=by_value)
    except OSError as error:
        raise LaunchRefusedError(
            f"cannot write the call's arguments to {os.path.dirname(spec.directory)}: {error}. "
            f"{_space_hint(spec.directory)}"
        ) from error
    except Exception as error:
        culprit = _checks.describe_unpicklable(payload.args, payload.kwargs, by_value)
        raise LaunchRefusedError(
            f"cannot send the call to {spec.start_method!r} workers: {culprit}. Under 'spawn' and 'forkserver' "
            "every argument is pickled; pass picklable values, create the object inside the function, or use "
            "start_method='fork'."
        ) from error


def _nodes(config: LaunchConfig) -> NodeSetup | None:
    try:
        return node_setup(config.nnodes, config.node_rank, config.rdzv_endpoint)
    except ValueError as error:
        raise InvalidOptionError(str(error)) from None


def _run_in_process(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: LaunchConfig) -> Any:
    """Already one rank of an outer launcher's job: run the function here, as that rank, and return its value
    (a one-element list with ``return_all``); nothing is launched."""
    from mplaunch._worker import process_group

    backend = config.backend
    if backend is not None and torch.distributed.is_initialized():
        backend = None  # the caller already has its process group
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    with process_group(resolve_backend(backend, world_size), int(os.environ.get("LOCAL_RANK", "0"))):
        value = function._mplaunch_target(*args, **kwargs)
    return [value] if config.return_all else value


def _preload(function_module: str | None) -> list[str]:
    """Modules the fork server imports once, when it starts, so that its workers do not: torch, NumPy's
    random module when this process uses NumPy (restoring its state imports it), mplaunch's worker side, and
    the function's
    module. Only the first forkserver launch of a process starts the server, so later functions from other
    modules are imported by each worker."""
    modules = ["__main__", "torch", "lightning_utilities", "mplaunch._worker"]
    if "numpy" in sys.modules:
        modules.append("numpy.random")  # imported lazily by NumPy 2; restoring its state would import it
    if function_module and function_module != "__main__":
        modules.append(function_module)
    return modules


def _run_workers(
    spec: WorkerSpec,
    payload: Payload | None,
    config: LaunchConfig,
    payload_module: str | None = None,
    control: LaunchControl | None = None,
) -> list[Any]:
    context = mp.get_context(spec.start_method)
    processes: list[BaseProcess] = []
    supervisor = Supervisor(spec, processes, config, control)
    try:
        with _main_without_file():
            if spec.start_method == "forkserver":
                context.set_forkserver_preload(_preload(payload_module))
                multiprocessing.forkserver.ensure_running()  # before signals are blocked: it must not inherit that
            with _signals_blocked():
                for rank in range(spec.nprocs):
                    process = context.Process(  # type: ignore[attr-defined]
                        target=run, args=(rank, spec, payload), name=f"mplaunch-rank{rank}", daemon=False
                    )
                    process.start()
                    processes.append(process)
        results: list[Any] = supervisor.wait()
        return results
    finally:
        supervisor.stop()
        for process in processes:
            process.close()
