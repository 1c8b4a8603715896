"""What every worker is told as it starts, by lifetime: the launch's :class:`LaunchSpec` (fixed for all its
attempts, or for the life of warm workers), one start's :class:`AttemptSpec` (where the ranks meet, the
descriptors of their output), and, per rank, a :class:`WorkerSpec` of the two and its own outcome file.

Each is built once, in one place: :func:`mplaunch._parent.launch.launch_spec` and ``attempt_spec``, and the
worker's by the start of its rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mplaunch._wire.inherited import InheritedFd


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one local rank runs, decided in the parent before any worker starts (``devices=``,
    ``cpu_binding=``, ``env=``).

    Attributes:
        cuda_visible_devices: the rank's ``CUDA_VISIBLE_DEVICES`` (the launch's devices, in order), or ``None``
            to keep the parent's.
        cpus: the CPUs the rank is pinned to (``os.sched_setaffinity``), or ``None`` to keep the parent's mask.
        numa_node: the NUMA node whose memory the rank prefers, or ``None`` for the kernel's default policy.
        num_threads: intra-op threads for the rank (the size of its CPU set), or ``None`` for the launch's.
        environ: the variables of ``env=`` for this rank, set after torchrun's.
    """

    cuda_visible_devices: str | None = None
    cpus: tuple[int, ...] | None = None
    numa_node: int | None = None
    num_threads: int | None = None
    environ: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class RankFds:
    """What one local rank puts in place of fd 1 and fd 2 (see :mod:`mplaunch._output.rank_streams`)."""

    stdout: InheritedFd
    stderr: InheritedFd
    routed: bool  # pipes to the parent (else the caller's own fd 1 and 2)
    announce: bool = False  # write RANK_MARK first: the parent does not know this worker's global rank


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What every worker of one launch (every attempt of it), or of one set of warm workers, needs to know.

    Attributes:
        directory: the launch directory: the payload, outcomes, stacks, the board and flag are there.
        nprocs: ranks on this node.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        parent_pid: the launching process, which a worker must not outlive.
        num_threads: intra-op threads for each worker.
        reporting_ranks: ranks whose return value is sent back (the others send ``None``).
        environ: the parent's environment for forkserver workers (they inherit the server's), else ``None``.
        backend: the process-group backend each rank joins around the function, or ``None``.
        prefix_output, console_ranks, log_dir: the output options (see :mod:`mplaunch._output`).
        grace_period: seconds a stopped worker has before SIGKILL; its own children get part of it.
        mp_start_method: the parent's ``multiprocessing`` default start method if it set one, else ``None``.
        unshare: forked workers must look for arguments in shared memory (see ``unshare_verdict``);
            ``None``: the arguments are large, and the parent says whether on the attempt's ``unshare_pipe``.
        ignored_signals: the stop signals the workers ignore (SIGTERM never): those the caller ignores.
        placements: per local rank, its devices, CPUs and extra variables, or ``None``.
        env_function: ``env=``'s function of the global rank, called in each worker of a multi-node launch.
        post_mortem: the first rank that raises opens pdb on the terminal.
        stacks: the parent may ask the ranks for their stacks: each installs its dump handler.
        board: the launch has a board that each rank opens (heartbeats, usage at exit).
        max_restarts: the launch's ``TORCHELASTIC_MAX_RESTARTS``.
        result_wait: seconds the first worker of a node other than rank 0's waits for rank 0's result in the
            rendezvous store (multi-node).
        payload_fd: the memory file holding the payload, or ``None``: inherited (fork), or in the directory.
        start_objects: the call's objects that ``multiprocessing`` sends only to a starting process (queues,
            locks...), which the payload refers to by index (see :mod:`mplaunch._wire.start_objects`).
    """

    directory: str
    nprocs: int
    start_method: str
    parent_pid: int
    num_threads: int
    reporting_ranks: frozenset[int]
    environ: dict[str, str] | None = None
    backend: str | None = None
    prefix_output: bool | str = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    grace_period: float = 5.0
    mp_start_method: str | None = None
    unshare: bool | None = True
    ignored_signals: frozenset[int] = frozenset()
    placements: tuple[RankPlacement, ...] | None = None
    env_function: Callable[[int], Any] | None = None
    post_mortem: bool = False
    stacks: bool = True
    board: bool = True
    max_restarts: int = 0
    result_wait: float = 600.0
    payload_fd: InheritedFd | None = None
    start_objects: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptSpec:
    """What the workers of one start of the ranks (an attempt) need to know besides the launch's spec.

    Attributes:
        master_addr, master_port: the rendezvous store.
        agent_store: the parent hosts the store (torchrun's agent store).
        restart_count: this attempt's ``TORCHELASTIC_RESTART_COUNT``.
        output_fds: per local rank, the descriptors that replace fd 1 and 2, else ``None`` (they are kept).
        unshare_pipe: ``(read end, write end)`` of the pipe on which the parent, once every forked worker
            has started, writes one byte per worker: ``b"1"`` to look in its arguments for shared memory.
    """

    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = True
    restart_count: int = 0
    output_fds: tuple[RankFds, ...] | None = None
    unshare_pipe: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker is started with: its launch's and attempt's specs, and the memory file it writes its
    outcome into (``None``: the launch directory)."""

    launch: LaunchSpec
    attempt: AttemptSpec = AttemptSpec()
    outcome_fd: InheritedFd | None = None
