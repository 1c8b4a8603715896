"""Train a small classifier on scikit-learn's digits with DistributedDataParallel on 2 processes.

The parent loads the data and splits it; ``train`` runs on 2 workers (gloo backend, CPU), each on its half
of the training set; rank 0's trained weights come back to the parent, which scores them on the held-out
split. Run: ``python examples/train_digits.py`` (or ``make demo``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from mplaunch import parallel, worker_info


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


@parallel(nprocs=2, start_method="spawn")
def train(features: torch.Tensor, labels: torch.Tensor, epochs: int = 30, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """Runs in each worker: rank and world size come from the environment, as under torchrun."""
    dist.init_process_group("gloo")
    try:
        info = worker_info()
        model = DistributedDataParallel(make_model())
        dataset = TensorDataset(features, labels)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
            if info.rank == 0 and (epoch + 1) % 10 == 0:
                print(f"[rank 0] epoch {epoch + 1:3d}  loss {loss.item():.4f}", flush=True)
        return model.module.state_dict()
    finally:
        dist.destroy_process_group()


def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    torch.manual_seed(0)
    start = time.perf_counter()
    weights = train(x_train, y_train, epochs=30)
    elapsed = time.perf_counter() - start
    model = make_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    print(f"trained on {len(x_train)} digits with 2 processes in {elapsed:.1f} s")
    print(f"accuracy on {len(x_test)} held-out digits: {accuracy:.3f}")


if __name__ == "__main__":
    main()
