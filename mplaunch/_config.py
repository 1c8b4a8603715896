"""The launch options, validated once when a function is decorated."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from collections.abc import Iterable

from mplaunch._cgroup import cpu_limit
from mplaunch._errors import InvalidOptionError

START_METHODS = ("spawn", "fork", "forkserver")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """Options of one decorated function. Build it with :func:`make_config`, which validates every field.

    Attributes:
        nprocs: number of worker processes started by one call, or ``"auto"`` (see :func:`resolve_nprocs`).
        start_method: ``"spawn"``, ``"fork"``, ``"forkserver"``, or ``None`` to choose at call time.
        return_all: return a list of every rank's value ordered by rank instead of rank 0's value.
        timeout: seconds the whole launch may take, or ``None`` for no limit.
        grace_period: seconds a worker gets between SIGTERM and SIGKILL when the launch stops it.
        backend: process-group backend each worker initialises around the function (``"gloo"``,
            ``"nccl"``, ``"auto"``, ...), or ``None`` to leave process groups to the function.
        prefix_output: prefix each line a worker prints with ``[rank N] ``.
        console_ranks: the ranks whose output reaches the console, or ``None`` for every rank.
        log_dir: a directory where each rank's output is also written to ``rank{N}.log``, or ``None``.
        nnodes: number of nodes, or ``None`` to read it from the environment (one node if unset).
        node_rank: this node's index, or ``None`` (informative: c10d rendezvous orders the nodes).
        rdzv_endpoint: ``host[:port]`` of the c10d rendezvous on a multi-node launch.
        max_restarts: how often all workers are restarted after a failure (by mplaunch on one node, by
            torch.distributed.elastic on several), as torchrun's ``--max-restarts``.
        rdzv_timeout: seconds to wait for every node to join a multi-node launch.
    """

    nprocs: int | str = 1
    start_method: str | None = None
    return_all: bool = False
    timeout: float | None = None
    grace_period: float = 5.0
    backend: str | None = None
    prefix_output: bool = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    rdzv_timeout: float = 600.0


def make_config(
    *,
    nprocs: int | str,
    start_method: str | None,
    return_all: bool,
    timeout: float | None,
    grace_period: float,
    backend: str | None = None,
    prefix_output: bool = False,
    console_ranks: Iterable[int] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout: float = 600.0,
) -> LaunchConfig:
    """Validate the options and return them as a :class:`LaunchConfig`.

    Raises:
        InvalidOptionError: an option has a wrong type or value; the message names it and the allowed values.
    """
    if nprocs != "auto" and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise InvalidOptionError(
            f"nprocs={nprocs!r} is not valid: pass a whole number of processes >= 1 (e.g. nprocs=2), or 'auto'."
        )
    available = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in available:
        raise InvalidOptionError(
            f"start_method={start_method!r} is not available on this platform: use one of "
            f"{', '.join(repr(m) for m in available)}, or None to let mplaunch choose."
        )
    if not isinstance(return_all, bool):
        raise InvalidOptionError(f"return_all={return_all!r} is not valid: pass True or False.")
    if timeout is not None and not _is_positive_seconds(timeout):
        raise InvalidOptionError(
            f"timeout={timeout!r} is not valid: pass a number of seconds > 0, or None for no limit."
        )
    if not _is_positive_seconds(grace_period, allow_zero=True):
        raise InvalidOptionError(f"grace_period={grace_period!r} is not valid: pass a number of seconds >= 0.")
    _check_backend(backend)
    if not isinstance(prefix_output, bool):
        raise InvalidOptionError(f"prefix_output={prefix_output!r} is not valid: pass True or False.")
    ranks = None if console_ranks is None else _check_ranks(console_ranks)
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise InvalidOptionError(f"log_dir={log_dir!r} is not valid: pass a directory path, or None.")
    for name, value, low in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0), ("max_restarts", max_restarts, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            what = " of restarts after a worker failure (0: none)" if name == "max_restarts" else ""
            raise InvalidOptionError(f"{name}={value!r} is not valid: pass a whole number{what} >= {low}.")
    if rdzv_endpoint is not None and (not isinstance(rdzv_endpoint, str) or not rdzv_endpoint):
        raise InvalidOptionError(f"rdzv_endpoint={rdzv_endpoint!r} is not valid: pass 'host:port', e.g. 'node0:29400'.")
    if not _is_positive_seconds(rdzv_timeout):
        raise InvalidOptionError(f"rdzv_timeout={rdzv_timeout!r} is not valid: pass a number of seconds > 0.")
    return LaunchConfig(
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        rdzv_timeout=float(rdzv_timeout),
        backend=backend,
        prefix_output=prefix_output,
        console_ranks=ranks,
        log_dir=None if log_dir is None else os.path.abspath(os.fspath(log_dir)),
        nprocs=nprocs,
        start_method=start_method,
        return_all=return_all,
        timeout=None if timeout is None else float(timeout),
        grace_period=float(grace_period),
    )


def _check_ranks(console_ranks: Iterable[int]) -> frozenset[int]:
    message = (
        f"console_ranks={console_ranks!r} is not valid: pass the ranks whose output should reach the console as "
        "a collection of whole numbers >= 0 (e.g. console_ranks=[0]), or None for every rank."
    )
    if isinstance(console_ranks, (str, bytes)):
        raise InvalidOptionError(message)
    try:
        ranks = frozenset(console_ranks)
    except TypeError:
        raise InvalidOptionError(message) from None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise InvalidOptionError(message)
    return ranks


def _check_backend(backend: str | None) -> None:
    if backend is None or backend == "auto":
        return
    import torch.distributed as dist

    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    if not isinstance(backend, str) or backend.lower() not in known:
        raise InvalidOptionError(
            f"backend={backend!r} is not valid: use one of {', '.join(repr(b) for b in known)}, 'auto' (nccl when "
            "there is a CUDA device per worker, else gloo), or None to initialise process groups yourself."
        )


def resolve_backend(backend: str | None, nprocs: int) -> str | None:
    """Turn ``"auto"`` into ``"nccl"`` when CUDA is available with at least ``nprocs`` devices, else
    ``"gloo"``; other values are returned as they are. Does not initialise CUDA."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def _is_positive_seconds(value: object, *, allow_zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if allow_zero else value > 0


def usable_cpu_count() -> int:
    """Return the number of CPUs this process may use, at least 1: the smaller of its affinity mask and its
    cgroup CPU quota (Docker ``--cpus``, Kubernetes limits; v1 and v2), the quota rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_limit()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def resolve_nprocs(nprocs: int | str) -> int:
    """Turn ``nprocs`` into a number: ``"auto"`` is the number of visible CUDA devices when CUDA is
    available, otherwise the number of usable CPU cores (affinity mask and cgroup quota). Probing CUDA this
    way does not initialise it."""
    if isinstance(nprocs, int):
        return nprocs
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return usable_cpu_count()
