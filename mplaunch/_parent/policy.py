"""Launch policy, decided in the parent: the default start method, ``nprocs="auto"``, ``backend="auto"``, and
each worker's intra-op threads. Forked workers keep ``cores // nprocs`` threads because the parent frees its
OpenMP pools right before forking (:mod:`mplaunch._platform.openmp`); where none can be freed, they get one
thread, as PyTorch's DataLoader workers always do."""

from __future__ import annotations

import multiprocessing
import os
import sys

from mplaunch._env import whole_number
from mplaunch._frames import warn_at_user
from mplaunch._parent import devices as device_pool
from mplaunch._platform import openmp
from mplaunch._platform.cpus import usable_cpu_count

_warned = _said_spawn = False


def is_interactive() -> bool:
    """Tell whether this is the REPL, ``python -i``, or an IPython/Jupyter shell."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def default_start_method() -> str:
    """Return ``fork`` in an interactive session where forked workers could use CUDA, else ``spawn`` (said once)."""
    global _said_spawn
    if not is_interactive() or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    refusal = device_pool.fork_refusal()
    if refusal is not None and not _said_spawn:
        _said_spawn = True
        warn_at_user(
            f"mplaunch: workers start with spawn here, not fork: {refusal[0]}, so forked ones could not use CUDA.",
            RuntimeWarning,
        )
    return "fork" if refusal is None else "spawn"


def resolve_nprocs(nprocs: int | str) -> int:
    """Turn ``"auto"`` into the visible CUDA devices (without initialising CUDA), else the usable CPU cores."""
    if isinstance(nprocs, int):
        return nprocs
    return device_pool.device_count() or usable_cpu_count()


def resolve_backend(backend: str | None, nprocs: int, devices: int | None = None) -> str | None:
    """Turn ``"auto"`` into ``"nccl"`` given ``nprocs`` devices (``devices``, else visible ones), else ``"gloo"``."""
    if backend != "auto":
        return backend
    count = device_pool.device_count() if devices is None else devices
    return "nccl" if count >= nprocs else "gloo"


def wanted_threads(nprocs: int, environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """Return the user's ``OMP_NUM_THREADS`` when it is a number, else usable cores // nprocs (at least 1)."""
    user = whole_number(environ.get("OMP_NUM_THREADS", ""))
    return max(1, user if user is not None else usable_cpu_count() // nprocs)


def worker_threads(nprocs: int, start_method: str, wanted: int | None = None) -> int:
    """Return ``wanted`` threads, freeing the OpenMP pools under fork; if that fails, 1 (warned once)."""
    global _warned
    wanted = wanted_threads(nprocs) if wanted is None else wanted
    if start_method != "fork" or wanted == 1 or openmp.release_pools():
        return wanted
    if not _warned:
        _warned = True
        warn_at_user(
            "mplaunch: this process's OpenMP thread pool could not be released before fork (another thread "
            "may be running a parallel torch operation), and GNU OpenMP's pool does not survive fork, so "
            f"forked workers use 1 intra-op thread each instead of {wanted} (else they could hang). Use "
            "start_method='forkserver' or 'spawn' for more.",
            RuntimeWarning,
        )
    return 1
