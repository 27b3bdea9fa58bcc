"""Train a small ResNet-style CNN on scikit-learn's handwritten digits with hvdplus (Horovod's recipe).

Each rank trains on its shard of the data (DistributedSampler); gradients are averaged by
hvd.DistributedOptimizer; rank 0 shows a progress bar, prints the accuracy and throughput of every epoch,
saves a checkpoint every epoch, and a restarted job resumes from the latest one. Run it with any launcher:

    hvdplusrun -np 2 python examples/pytorch_train.py --epochs 5
    mpirun -np 2 --oversubscribe python examples/pytorch_train.py --epochs 5
    python examples/pytorch_train.py            # one process, no launcher

One process with --batch-size 64 --lr 0.04 trains with the global batch and learning rate of 2 ranks with the
defaults (32 samples per rank, 0.02 scaled by 2). --summary-json PATH writes the final accuracy and images/s as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hvdplus.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and backward pass")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank (scaled by the ranks)")
    parser.add_argument("--fp16", action="store_true", help="compress gradients to float16 for the allreduce")
    parser.add_argument(
        "--batches-per-allreduce", type=int, default=1, help="backward passes accumulated locally per allreduce"
    )
    parser.add_argument("--sync-bn", action="store_true", help="use hvd.SyncBatchNorm (statistics over all ranks)")
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--summary-json",
        metavar="PATH",
        help="rank 0 writes the final test accuracy and the training images/s (all ranks together) here as JSON",
    )
    return parser.parse_args()


class Block(torch.nn.Module):
    """A residual block: two 3x3 convolutions with batch norm, plus the identity."""

    def __init__(self, channels: int, norm: type) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


def make_model(norm: type) -> torch.nn.Module:
    """Stem, two residual blocks, global average pooling and a linear classifier for 8x8 digits."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1, bias=False),
        norm(32),
        torch.nn.ReLU(),
        Block(32, norm),
        Block(32, norm),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The 1797 8x8 digits scaled to [0, 1], in a fixed random order: 1500 to train, the rest to test."""
    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)[order] / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)[order]
    return TensorDataset(images[:1500], labels[:1500]), TensorDataset(images[1500:], labels[1500:])


def checkpoint_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"checkpoint-{epoch}.pt")


def latest_epoch(directory: str, epochs: int) -> int:
    """The last epoch with a checkpoint (0 if none); only rank 0 looks, the others learn it by broadcast."""
    found = [e for e in range(epochs, 0, -1) if os.path.exists(checkpoint_path(directory, e))]
    return found[0] if found else 0


def average(value: float, name: str) -> float:
    """The mean of `value` over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train_epoch(
    model, optimizer, loader, sampler, epoch: int, args: argparse.Namespace
) -> tuple[float, float, int, float]:
    """One epoch; each loader batch is split into backward passes of --batch-size samples.

    Returns the loss and accuracy (means over the ranks), the images all ranks trained on, and the seconds it took
    (the mean over the ranks, which step together)."""
    model.train()
    sampler.set_epoch(epoch)
    total_loss, correct, seen = 0.0, 0, 0
    began = time.perf_counter()
    with tqdm(total=len(loader), desc=f"epoch {epoch}", disable=hvd.rank() != 0) as bar:
        for images, labels in loader:
            optimizer.zero_grad()
            passes = (len(images) + args.batch_size - 1) // args.batch_size
            for start in range(0, len(images), args.batch_size):
                x, y = images[start : start + args.batch_size], labels[start : start + args.batch_size]
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                (loss / passes).backward()
                total_loss += loss.item() * len(x)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(x)
            optimizer.step()
            bar.set_postfix(loss=f"{total_loss / seen:.3f}")
            bar.update(1)
    seconds = time.perf_counter() - began
    images = hvd.allreduce(torch.tensor(seen), op=hvd.Sum, name=f"train.images.{epoch}").item()
    return (
        average(total_loss / seen, f"train.loss.{epoch}"),
        average(correct / seen, f"train.accuracy.{epoch}"),
        images,
        average(seconds, f"train.seconds.{epoch}"),
    )


def test_accuracy(model: torch.nn.Module, test_set: TensorDataset, epoch: int) -> float:
    """Accuracy over the whole test set: each rank scores every size-th sample, the counts are summed."""
    model.eval()
    images, labels = test_set.tensors
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(images[mine]).argmax(1) == labels[mine]).sum().double()
    counts = hvd.allreduce(
        torch.stack([correct, torch.tensor(float(len(labels[mine])), dtype=torch.float64)]),
        op=hvd.Sum,
        name=f"test.accuracy.{epoch}",
    )
    return (counts[0] / counts[1]).item()


def write_summary(args: argparse.Namespace, accuracy: float, timed: list[tuple[int, float]], ranks: int) -> None:
    """--summary-json: the final test accuracy, the settings that decide it, and the throughput of training
    (images over all ranks per second; the first epoch, which warms up, is left out when later ones ran)."""
    steady = timed[1:] or timed
    summary = {
        "example": "pytorch_train",
        "ranks": ranks,
        "global_batch_size": args.batch_size * args.batches_per_allreduce * ranks,
        "learning_rate": args.lr * ranks * args.batches_per_allreduce,
        "epochs": args.epochs,
        "epochs_trained": len(timed),
        "test_accuracy": accuracy,
        "images_per_second": sum(i for i, _ in steady) / sum(s for _, s in steady) if steady else None,
        "train_seconds": sum(s for _, s in timed),
    }
    with open(args.summary_json, "w") as f:
        json.dump(summary, f, indent=2)


def main() -> None:
    args = parse_args()
    hvd.init()
    root, ranks = hvd.rank() == 0, hvd.size()  # asked once: local calls fail once a peer has shut down
    if "OMP_NUM_THREADS" not in os.environ:
        # torch takes a thread per core in every process: share the cores among the ranks on this machine instead.
        torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size * args.batches_per_allreduce, sampler=sampler)

    model = make_model(hvd.SyncBatchNorm if args.sync_bn else torch.nn.BatchNorm2d)
    # Scale the learning rate by the number of samples that one step averages over.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size() * args.batches_per_allreduce, momentum=0.9)

    resume = latest_epoch(args.checkpoint_dir, args.epochs) if hvd.rank() == 0 else 0
    resume = hvd.broadcast_object(resume, root_rank=0, name="resume_epoch")
    if resume and root:
        state = torch.load(checkpoint_path(args.checkpoint_dir, resume))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        print(f"Resuming from checkpoint of epoch {resume}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none,
        backward_passes_per_step=args.batches_per_allreduce,
    )

    timed = []  # (images, seconds) of each epoch trained
    for epoch in range(resume + 1, args.epochs + 1):
        loss, accuracy, images, seconds = train_epoch(model, optimizer, loader, sampler, epoch, args)
        timed.append((images, seconds))
        accuracy_test = test_accuracy(model, test_set, epoch)
        if root:
            print(
                f"Epoch {epoch}: train loss {loss:.4f}, train accuracy {accuracy:.4f}, "
                f"test accuracy {accuracy_test:.4f}, {images / seconds:.0f} images/s"
            )
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                checkpoint_path(args.checkpoint_dir, epoch),
            )
    final = test_accuracy(model, test_set, args.epochs + 1)
    if root:
        print(f"Final test accuracy: {final:.4f} ({ranks} rank{'s' if ranks > 1 else ''})")
        if args.summary_json:
            write_summary(args, final, timed, ranks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
