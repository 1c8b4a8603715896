"""In a worker, before the function: apply the placement the parent chose (devices, CPUs, NUMA node, ``env=``).

The NUMA policy is ``set_mempolicy(MPOL_PREFERRED)``, as ``numactl --preferred``; where the kernel or seccomp
refuses it, first-touch placement applies, which the CPU binding makes local too."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
from typing import Any

from mplaunch._env import check_extra_env, whole_number
from mplaunch._wire.spec import WorkerSpec

_MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "riscv64": 237, "ppc64le": 261, "s390x": 270}
_env_threads: int | None = None  # OMP_NUM_THREADS given through env=


def environment(spec: WorkerSpec, local_rank: int) -> dict[str, str]:
    """Return the variables this rank's placement sets: ``CUDA_VISIBLE_DEVICES``, then ``env=``'s."""
    placement = spec.launch.placements[local_rank] if spec.launch.placements is not None else None
    if placement is None:
        return {}
    extra = {} if placement.cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices}
    extra.update(placement.environ)
    return extra


def apply(spec: WorkerSpec, local_rank: int, rank: int, *, environ_made: bool = False) -> dict[str, str]:
    """Set this rank's placement variables (unless ``environ_made``), add ``PYTHONPATH`` to ``sys.path``, pin CPUs."""
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
    # a spawned interpreter had them, until multiprocessing gave it the parent's sys.path
    sys.path[1:1] = [entry for entry in extra.get("PYTHONPATH", "").split(os.pathsep) if entry not in ("", *sys.path)]
    if placement is not None and placement.cpus:
        os.sched_setaffinity(0, placement.cpus)
        if placement.numa_node is not None:
            prefer_node(placement.numa_node)
    return extra


def set_changed(variables: dict[str, str]) -> None:
    """Set each of ``variables`` not set to that value yet (each ``setenv`` copies pages shared with the parent)."""
    for name, value in variables.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def threads_in(environ: dict[str, str]) -> int | None:
    """Return the thread count ``OMP_NUM_THREADS`` in ``environ`` asks for, else ``None``."""
    threads = whole_number(environ.get("OMP_NUM_THREADS", ""))
    return None if threads is None else max(1, threads)


def thread_count(spec: WorkerSpec, local_rank: int) -> int:
    """Return this rank's intra-op threads, after :func:`apply`."""
    return planned_threads(spec, local_rank, _env_threads)


def planned_threads(spec: WorkerSpec, local_rank: int, env_threads: int | None) -> int:
    """Return ``env=``'s ``OMP_NUM_THREADS``, else the CPU binding's count, else the launch's."""
    if env_threads is not None:
        return env_threads
    placement = spec.launch.placements[local_rank] if spec.launch.placements is not None else None
    if placement is not None and placement.num_threads is not None:
        return placement.num_threads
    return spec.launch.num_threads


@functools.lru_cache(maxsize=1)
def _syscall() -> Any:
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    return None if number is None else functools.partial(ctypes.CDLL(None, use_errno=True).syscall, number)


def prefer_node(node: int) -> None:
    """Make this process prefer memory of NUMA node ``node``, where the kernel agrees."""
    syscall = _syscall()
    if syscall is None:
        return
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    with contextlib.suppress(OSError):
        syscall(_MPOL_PREFERRED, ctypes.byref(mask), ctypes.c_ulong(len(mask) * bits + 1))
