"""A training run that survives preemption: it saves a checkpoint when told and resumes from it on the next run.

``train`` runs DistributedDataParallel (gloo, CPU) on 2 workers, on synthetic data that depends only on the step
and the rank, from a seeded initialisation, so a run that is interrupted and resumed ends with exactly the
weights of a run that was not. Each step, the ranks agree (one small all-reduce) on whether the launch was
preempted: ``mplaunch.preempted()`` may turn true between two ranks' checks, and a rank that stopped alone would
leave its peers waiting in the next step's collective. When it is, rank 0 saves ``ckpt.pt`` (model, optimizer,
next step) and every rank returns; the call raises ``PreemptedError``, and the script exits with 128 + the
signal's number (143 for SIGTERM), which tells a scheduler to requeue it.

Run: ``python examples/preemptible.py --steps 200`` and press Ctrl-\\ or ``kill -TERM <pid>``; run it again to
resume. Under SLURM: ``#SBATCH --signal=TERM@90`` and ``--requeue``; under Kubernetes the pod's SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mplaunch
from mplaunch import parallel, worker_info


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every run
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic batch of ``rank`` at ``step``: the same on every run, whatever ran before."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


@parallel(nprocs=2, start_method="spawn", backend="gloo", preempt_signals=(signal.SIGTERM,), preempt_grace=60)
def train(directory: str, steps: int, pause: float = 0.0) -> dict[str, torch.Tensor]:
    """Train up to ``steps`` steps, resuming from ``directory/ckpt.pt`` if it exists; return the weights.

    When the launch is preempted, rank 0 saves the checkpoint at the end of the current step and every rank
    returns (the call then raises ``PreemptedError``).
    """
    rank = worker_info().rank
    checkpoint = os.path.join(directory, "ckpt.pt")
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    for step in range(start, steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        stop = torch.tensor([float(mplaunch.preempted())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        if stop.item():
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
                torch.save(state, checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)  # never a half-written checkpoint
                print(f"preempted: saved step {step + 1}", flush=True)
            return {}
        time.sleep(pause)
    return model.module.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".", help="where ckpt.pt and final.pt go")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of sleep per step (to watch it)")
    args = parser.parse_args()
    try:
        weights = train(args.dir, args.steps, args.pause)
    except mplaunch.PreemptedError as error:
        print(f"preempted by {error.signal_name}; run again to resume", flush=True)
        sys.exit(128 + (error.signum or signal.SIGTERM))  # 143: the scheduler requeues the job
    torch.save(weights, os.path.join(args.dir, "final.pt"))
    print("done", flush=True)


if __name__ == "__main__":
    main()
