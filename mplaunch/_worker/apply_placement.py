"""In a worker, before the function: take the placement the parent chose for this rank (its devices, its
CPUs and NUMA node, the variables of ``env=``), see :class:`mplaunch._wire.placement.RankPlacement`.

The affinity is this worker's own (``os.sched_setaffinity(0, ...)``), never the parent's. The NUMA memory
policy is set with the ``set_mempolicy`` system call (``MPOL_PREFERRED`` on the rank's node), as
``numactl --preferred`` does; where the kernel or a container's seccomp profile refuses it, the kernel's
default (memory on the node of the CPU that touches it first) applies, which the CPU binding makes local too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from typing import Any

from mplaunch._env import check_extra_env, whole_number
from mplaunch._wire.spec import WorkerSpec

_MPOL_PREFERRED = 1
#: set_mempolicy's system call number by machine.
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "riscv64": 237, "ppc64le": 261, "s390x": 270}
_env_threads: int | None = None  # OMP_NUM_THREADS given through env=


def environment(spec: WorkerSpec, local_rank: int) -> dict[str, str]:
    """The variables that this rank's placement sets: ``CUDA_VISIBLE_DEVICES`` (``devices=``), then those of
    ``env=`` (a dict, or a one-node launch's function, called by the parent)."""
    placement = spec.launch.placements[local_rank] if spec.launch.placements is not None else None
    if placement is None:
        return {}
    extra = {} if placement.cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices}
    extra.update(placement.environ)
    return extra


def apply(spec: WorkerSpec, local_rank: int, rank: int, *, environ_made: bool = False) -> None:
    """Set this rank's ``CUDA_VISIBLE_DEVICES`` and ``env=`` variables (after torchrun's), and pin it to its
    CPUs and NUMA node. ``environ_made``: the parent made the rank's whole environment, these variables
    included (:func:`mplaunch._platform.environ.fork_environs`), with ``OMP_NUM_THREADS`` already the count
    the rank runs (:func:`planned_threads`), so none is set here.

    Raises:
        InvalidOptionError: ``env=``'s function (multi-node launches call it here) returned a bad mapping.
    """
    global _env_threads
    placement = spec.launch.placements[local_rank] if spec.launch.placements is not None else None
    extra = environment(spec, local_rank)
    if spec.launch.env_function is not None:
        given = spec.launch.env_function(rank)
        extra.update(
            check_extra_env(
                given, f"env({rank})", devices=placement is not None and placement.cuda_visible_devices is not None
            )
        )
    if not environ_made:
        set_changed(extra)
    _env_threads = threads_in(extra)
    if placement is not None and placement.cpus:
        os.sched_setaffinity(0, placement.cpus)
        if placement.numa_node is not None:
            prefer_node(placement.numa_node)


def set_changed(variables: dict[str, str]) -> None:
    """Set each of ``variables`` in ``os.environ`` that does not have that value yet (each ``setenv`` in a
    forked worker copies pages of the heap it shares with the parent)."""
    for name, value in variables.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def threads_in(environ: dict[str, str]) -> int | None:
    """The thread count that ``OMP_NUM_THREADS`` in ``environ`` (``env=``'s) asks for, else ``None``."""
    threads = whole_number(environ.get("OMP_NUM_THREADS", ""))
    return None if threads is None else max(1, threads)


def thread_count(spec: WorkerSpec, local_rank: int) -> int:
    """Intra-op threads for this rank (after :func:`apply`): ``OMP_NUM_THREADS`` from ``env=``, else its CPU
    set's size with ``cpu_binding`` (when the user did not set ``OMP_NUM_THREADS``), else the launch's."""
    return planned_threads(spec, local_rank, _env_threads)


def planned_threads(spec: WorkerSpec, local_rank: int, env_threads: int | None) -> int:
    """:func:`thread_count` with ``env_threads`` as ``env=``'s ``OMP_NUM_THREADS`` (``None``: not given)."""
    if env_threads is not None:
        return env_threads
    placement = spec.launch.placements[local_rank] if spec.launch.placements is not None else None
    if placement is not None and placement.num_threads is not None:
        return placement.num_threads
    return spec.launch.num_threads


@functools.lru_cache(maxsize=1)
def _syscall() -> Any:
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return None
    return functools.partial(ctypes.CDLL(None, use_errno=True).syscall, number)


def prefer_node(node: int) -> bool:
    """Make this process prefer memory of NUMA node ``node``; return whether the kernel agreed."""
    syscall = _syscall()
    if syscall is None:
        return False
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    with contextlib.suppress(OSError):
        return bool(syscall(_MPOL_PREFERRED, ctypes.byref(mask), ctypes.c_ulong(len(mask) * bits + 1)) == 0)
    return False
