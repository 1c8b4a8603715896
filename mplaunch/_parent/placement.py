"""The placement of each rank of a launch, decided in the parent before any worker starts: the launch's devices
(``devices=``), each rank's CPUs (``cpu_binding=``) and its extra variables (``env=``). Each worker applies its
own (:mod:`mplaunch._worker.apply_placement`); the parent's environment and affinity are never changed."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping

from mplaunch._config import ParallelConfig
from mplaunch._env import check_extra_env
from mplaunch._errors import InvalidOptionError, LaunchRefusedError
from mplaunch._parent import devices as device_pool
from mplaunch._platform import topology
from mplaunch._wire.spec import RankPlacement


def plan(
    config: ParallelConfig, nprocs: int, names: list[str] | None, *, multinode: bool, threads_kept: bool
) -> tuple[RankPlacement, ...] | None:
    """Return each local rank's :class:`RankPlacement`, or ``None`` when no option asks for one."""
    if names is None and config.cpu_binding is None and config.env is None:
        return None
    cuda = ",".join(names) if names is not None else None
    cpus: list[tuple[int | None, tuple[int, ...] | None]] = [(None, None)] * nprocs
    if config.cpu_binding is not None:
        cpus = _bind(config.cpu_binding, nprocs, names)
    sharing = {cpu_set: sum(1 for _, other in cpus if other == cpu_set) for _, cpu_set in cpus}
    placements = []
    for rank in range(nprocs):
        node, rank_cpus = cpus[rank]
        placements.append(
            RankPlacement(
                cuda_visible_devices=cuda,
                cpus=rank_cpus,
                numa_node=node,
                # ranks on one NUMA node share its cores: never more threads than cores
                num_threads=max(1, len(rank_cpus) // sharing[rank_cpus]) if rank_cpus and threads_kept else None,
                environ=_rank_env(config.env, rank, names is not None, multinode),
            )
        )
    return tuple(placements)


#: Python variables that take effect in a rank after it started (mplaunch applies the first two there).
_AFTER_START = ("PYTHONPATH", "PYTHONWARNINGS", "PYTHONBREAKPOINT", "PYTHONASYNCIODEBUG")


def check_fork_env(placements: tuple[RankPlacement, ...] | None, start_method: str) -> None:
    """Refuse an ``env=`` variable that Python reads only as it starts (``PYTHONHASHSEED``...) for a forked rank."""
    if start_method != "fork":
        return
    for rank, placement in enumerate(placements or ()):
        for name, value in placement.environ.items():
            if name.startswith("PYTHON") and name not in _AFTER_START and os.environ.get(name) != value:
                raise InvalidOptionError(
                    f"env sets {name}={value!r} (rank {rank}), which Python reads only as it starts, and a 'fork' "
                    "rank is a copy of this process, started already: use start_method='spawn' or 'forkserver', "
                    "or set it before this process starts."
                )


def env_function(config: ParallelConfig, start_method: str) -> Callable[[int], Mapping[str, str]] | None:
    """Return ``env=``'s function for multi-node workers to call; refuse one spawn/forkserver cannot pickle."""
    if not callable(config.env):
        return None
    if start_method != "fork":
        try:
            pickle.dumps(config.env)
        except Exception as error:
            raise InvalidOptionError(
                f"env={config.env!r} cannot be sent to the workers of a multi-node launch ({error}): pass a "
                "function defined at the top level of a module, or a mapping."
            ) from error
    return config.env


def _rank_env(env: object, rank: int, devices: bool, multinode: bool) -> dict[str, str]:
    if isinstance(env, Mapping):
        return dict(env)
    if env is None or multinode:  # a multi-node worker calls the env= function itself
        return {}
    assert callable(env)
    return check_extra_env(env(rank), f"env({rank})", devices=devices)


def _bind(kind: str, nprocs: int, names: list[str] | None) -> list[tuple[int | None, tuple[int, ...] | None]]:
    """Return each rank's NUMA node (``"numa"``) and CPUs, within this process's affinity mask."""
    allowed = sorted(os.sched_getaffinity(0))
    if kind == "numa":
        preferred: list[int | None] = []
        if names is not None:
            preferred = [None if bus is None else topology.pci_numa_node(bus) for bus in device_pool.bus_ids(names)]
        return [(node, cpus) for node, cpus in topology.split_numa(allowed, nprocs, preferred=preferred)]
    try:
        return [(None, cpus) for cpus in topology.split_cores(allowed, nprocs)]
    except ValueError:
        raise LaunchRefusedError(
            f"cpu_binding='cores' cannot give each of {nprocs} ranks CPUs of its own: this process may use "
            f"{len(allowed)} CPU(s) ({topology_text(allowed)}). Use fewer processes, cpu_binding='numa', or None."
        ) from None


def topology_text(cpus: list[int]) -> str:
    """Format ``cpus`` as a short list for messages."""
    return ",".join(map(str, cpus[:16])) + ("..." if len(cpus) > 16 else "")
