"""The effect of ``cpu_binding`` on a CPU-bound DDP step: the median step time with ``cpu_binding="cores"``
(and ``"numa"``) against no binding, in the same run, rounds alternating so that a busy machine hurts each
alike::

    python benchmarks/cpu_binding.py [--nprocs 2] [--steps 30] [--rounds 3]

Every variant runs the same number of intra-op threads per rank (cores // nprocs), so the ratio shows the
pinning alone. Above 1.0: binding is slower; below: faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from mplaunch import parallel


def ddp_steps(steps: int, width: int) -> float:
    """The median seconds of one DDP training step (forward, backward, all-reduce, update) of an MLP."""
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) for _ in range(4)]
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        data = torch.randn(256, width)
        times = []
        for _ in range(steps + 3):  # 3 warm-up steps
            start = time.perf_counter()
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    options = parser.parse_args()
    run = parallel(nprocs=options.nprocs, start_method="forkserver", timeout=600, return_all=True)(ddp_steps)
    variants: dict[str, list[float]] = {"none": [], "cores": [], "numa": []}
    for _ in range(options.rounds):
        for name in variants:
            binding = None if name == "none" else name
            per_rank = run.options(cpu_binding=binding)(options.steps, options.width)  # type: ignore[arg-type]
            variants[name].append(max(per_rank))  # a DDP step is as slow as its slowest rank
    base = statistics.median(variants["none"])
    cpus = len(os.sched_getaffinity(0))
    print(f"CPU-bound DDP step, nprocs={options.nprocs}, {cpus} CPUs, median of {options.rounds} rounds")
    for name, samples in variants.items():
        median = statistics.median(samples)
        print(f"  cpu_binding={name!s:<6} {median * 1e3:8.2f} ms/step   {median / base:5.2f}x no binding")


if __name__ == "__main__":
    main()
