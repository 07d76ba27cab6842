"""A user's own DDP training script, as one brings it to kubetrain (written in the style of the
PyTorch DDP tutorial's multinode example, moved to CPU and gloo). It knows torch.distributed's
env:// contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
KUBETRAIN_CHECKPOINT_DIR, where its snapshot goes; nothing else of kubetrain, which it never imports.

Usage: python ddp_script.py TOTAL_EPOCHS SAVE_EVERY [--batch-size N]

Every rank reports on stdout, one write per line (a pod's ranks share one stdout):
  start rank=R local_rank=L world=W dist_rank=D dist_world=N
  resume rank=R epoch=E            (loaded the snapshot; training goes on at epoch E)
  epoch E rank R loss X
  snapshot epoch=E                 (rank 0)
  done rank=R
Failure drill: KUBETRAIN_FAIL_AT=RANK:EPOCH makes that rank exit 137 after the first batch of
EPOCH, that is once rank 0 has saved the snapshot of the epochs before it.
"""

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class SyntheticRegression(Dataset):
    """y = x·w + noise, the same samples on every rank (seeded)."""

    def __init__(self, size: int, features: int = 20) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=g)
        w = torch.randn(features, 1, generator=g)
        self.y = self.x @ w + 0.01 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def failure_drill(rank: int, epoch: int) -> None:
    target = os.environ.get("KUBETRAIN_FAIL_AT")
    if target and [int(v) for v in target.split(":")] == [rank, epoch]:
        say(f"failure drill: rank {rank} exits 137 in epoch {epoch}")
        os._exit(137)


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.data = data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model)  # CPU: no device_ids

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        say(f"resume rank={self.global_rank} epoch={self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()  # DDP all-reduces the gradients here
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)
        total = 0.0
        for i, (source, targets) in enumerate(self.data):
            total += self._run_batch(source, targets)
            if i == 0:
                failure_drill(self.global_rank, epoch)
        say(f"epoch {epoch} rank {self.global_rank} loss {total / len(self.data):.6f}")

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        say(f"snapshot epoch={epoch + 1}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP on CPU with a snapshot")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    say(f"start rank={os.environ['RANK']} local_rank={os.environ['LOCAL_RANK']} world={os.environ['WORLD_SIZE']} "
        f"dist_rank={dist.get_rank()} dist_world={dist.get_world_size()}")
    torch.manual_seed(0)
    dataset = SyntheticRegression(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    snapshot_path = os.path.join(os.environ["KUBETRAIN_CHECKPOINT_DIR"], "snapshot.pt")
    Trainer(model, loader, optimizer, args.save_every, snapshot_path).train(args.total_epochs)
    dist.barrier()
    dist.destroy_process_group()
    say(f"done rank={os.environ['RANK']}")
    # torch 2.13's gloo can abort in interpreter teardown after a clean destroy ("terminate called
    # without an active exception", exit 134) when peers exit at the same moment; a finished rank
    # leaves without that teardown, as many training scripts do.
    os._exit(0)


if __name__ == "__main__":
    main()
