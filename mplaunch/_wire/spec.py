"""What a worker is told as it starts, by lifetime: :class:`LaunchSpec`, :class:`AttemptSpec`, per rank a
:class:`WorkerSpec`; each built once (``launch_spec``, ``attempt_spec`` in :mod:`mplaunch._parent.launch`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mplaunch._wire.inherited import InheritedFd


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one local rank runs (``devices=``, ``cpu_binding=``, ``env=``); ``None``: the parent's, or default."""

    cuda_visible_devices: str | None = None
    cpus: tuple[int, ...] | None = None  # pinned with os.sched_setaffinity
    numa_node: int | None = None  # whose memory the rank prefers
    num_threads: int | None = None  # intra-op threads (the size of its CPU set)
    environ: dict[str, str] = dataclasses.field(default_factory=dict)  # env=, set after torchrun's


@dataclasses.dataclass(frozen=True, slots=True)
class RankFds:
    """What one local rank puts in place of fd 1 and 2 (:mod:`mplaunch._output.rank_streams`)."""

    stdout: InheritedFd
    stderr: InheritedFd
    routed: bool  # pipes to the parent (else the caller's own fd 1 and 2)
    announce: bool = False  # write RANK_MARK first: the parent does not know this worker's global rank


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What every worker of one launch (all its attempts), or of one set of warm workers, needs to know."""

    directory: str  # the launch directory: payload, outcomes, stacks, board and flag
    nprocs: int  # ranks on this node
    start_method: str
    parent_pid: int  # a worker must not outlive it
    num_threads: int
    reporting_ranks: frozenset[int]  # the others send None
    environ: dict[str, str] | None = None  # forkserver workers' (they inherit the server's), else None
    backend: str | None = None
    prefix_output: bool | str = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    grace_period: float = 5.0  # seconds before SIGKILL; a worker's own children get part of it
    mp_start_method: str | None = None  # the parent's multiprocessing default, if it set one
    ignored_signals: frozenset[int] = frozenset()  # the stop signals the caller ignores (never SIGTERM)
    placements: tuple[RankPlacement, ...] | None = None
    env_function: Callable[[int], Any] | None = None  # env='s function of the global rank (multi-node)
    post_mortem: bool = False  # the first rank that raises opens pdb
    stacks: bool = True  # each rank installs its stacks dump handler
    board: bool = True
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS
    seed: int | None = None  # each rank seeds its generators with (seed, rank)
    result_wait: float = 600.0  # seconds a non-rank-0 node waits for rank 0's result in the store
    payload_fd: InheritedFd | None = None  # None: inherited (fork), or in the directory
    start_objects: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptSpec:
    """What the workers of one attempt need to know besides the launch's spec."""

    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = True  # the parent hosts the store (torchrun's agent store)
    restart_count: int = 0
    output_fds: tuple[RankFds, ...] | None = None  # per local rank; None: fd 1 and 2 are kept


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker is started with; ``outcome_fd`` ``None``: it writes its outcome to the directory."""

    launch: LaunchSpec
    attempt: AttemptSpec = AttemptSpec()
    outcome_fd: InheritedFd | None = None
