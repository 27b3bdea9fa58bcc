"""ZeRO optimizer-state sharding with hvdplus: a small transformer classifier on scikit-learn's digits.

    mpirun -np 2 --oversubscribe python examples/pytorch_zero.py --zero     # AdamW state sharded over the ranks
    mpirun -np 2 --oversubscribe python examples/pytorch_zero.py            # the same with DistributedOptimizer
    mpirun -np 2 --oversubscribe python examples/pytorch_zero.py --offload  # ZeroOptimizer, AdamW on the host

On a machine with GPUs each rank trains on GPU `hvd.local_rank()` (`--no-cuda`: on the CPU); `--offload` then
keeps AdamW's master copy and state in pinned host memory and steps it there (ZeRO-Offload).

Each 8x8 image is a sequence of 8 rows; every rank trains on its part of each batch. Prints the optimizer-state
bytes this rank holds and the test accuracy (the two modes reach the same accuracy; the state halves on 2 ranks).
"""

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdplus.torch as hvd


class RowTransformer(torch.nn.Module):
    """Rows of the image as tokens, two encoder layers, mean-pooled into 10 classes."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.position = torch.nn.Parameter(torch.zeros(8, width))
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(images) + self.position).mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero", action="store_true", help="shard AdamW's state with hvd.ZeroOptimizer")
    parser.add_argument("--offload", action="store_true", help="--zero, with the optimizer in host memory")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU even where a GPU is present")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    args = parser.parse_args()
    hvd.init()
    device = torch.device("cpu")
    if torch.cuda.is_available() and not args.no_cuda:
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    x_train, x_test, y_train, y_test = (
        t.to(device) for t in train_test_split(images, torch.tensor(digits.target), test_size=0.2, random_state=0)
    )
    model = RowTransformer().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if args.zero or args.offload:
        offload = "optimizer" if args.offload else None
        optimizer = hvd.ZeroOptimizer(optimizer, named_parameters=model.named_parameters(), offload=offload)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    per_rank = args.batch_size // hvd.size()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch)).to(device)
        model.train()
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            mine = order[start + hvd.rank() * per_rank : start + (hvd.rank() + 1) * per_rank]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[mine]), y_train[mine]).backward()
            optimizer.step()
        scheduler.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    params = sum(p.numel() for p in model.parameters())
    where = {v.device.type for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
    print(
        f"rank {hvd.rank()}: {'ZeroOptimizer' if args.zero or args.offload else 'DistributedOptimizer'}, "
        f"{params} parameters, "
        f"optimizer state {state / 1024:.0f} KiB on this rank ({'/'.join(sorted(where))}), "
        f"test accuracy {accuracy:.3f}",
        flush=True,
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
