"""Where one rank runs: the record the parent hands each worker for ``devices=``, ``cpu_binding=`` and ``env=``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlacement:
    """The placement of one local rank, decided in the parent before any worker starts.

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
