"""A small DDP training script with ``DataLoader(num_workers=2)``, the same file under both launchers::

python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/ddp_script.py
python benchmarks/ddp_script.py --mplaunch      # @parallel(nprocs=2, start_method="spawn")
"""

import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(epochs: int = 1) -> float:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 32), torch.randn(2048, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=64, sampler=sampler, num_workers=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()
    return loss.item()


if __name__ == "__main__":
    if "--mplaunch" in sys.argv:
        from mplaunch import parallel

        print("loss", parallel(nprocs=2, start_method="spawn")(train)())
    else:
        print("loss", train())
