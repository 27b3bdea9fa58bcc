"""Elastic training of the digits CNN (examples/pytorch_train.py) with hvd.elastic: workers may fail or join
and training goes on in place, from the last commit, without restarting anyone or reading a checkpoint.

    hvdplusrun -np 4 --min-np 2 -H localhost:2,127.0.0.1:2 python examples/pytorch_elastic.py
    hvdplusrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh python examples/pytorch_elastic.py

`--fail-at STEP` makes the last rank of the first generation kill itself after that step, to watch recovery.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hvdplus.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_train import load_data, make_model, test_accuracy  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank (scaled by the ranks)")
    parser.add_argument("--batches-per-commit", type=int, default=1, help="steps between commits")
    parser.add_argument("--fail-at", type=int, default=None, help="the last rank kills itself after this step")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    model = make_model(torch.nn.BatchNorm2d)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    first_generation_size = hvd.size()

    def rescale_learning_rate() -> None:  # a reset changed the number of ranks the gradient averages over
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"Reset: now {hvd.size()} ranks", flush=True)

    state.register_reset_callbacks([rescale_learning_rate])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 (Horovod Elastic's idiom)
            model.train()
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
            for images, labels in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                if (
                    args.fail_at == state.batch
                    and hvd.size() == first_generation_size
                    and hvd.rank() == hvd.size() - 1
                    and os.environ.get("HVDPLUS_ELASTIC_GENERATION") == "0"
                ):
                    os.kill(os.getpid(), signal.SIGKILL)
            accuracy = test_accuracy(model, test_set, state.epoch)
            if hvd.rank() == 0:
                print(f"Epoch {state.epoch}: test accuracy {accuracy:.4f} ({hvd.size()} ranks)", flush=True)
            sampler.set_epoch(state.epoch + 1)
            state.batch = 0
            state.commit()

    train(state)
    final = test_accuracy(model, test_set, args.epochs)
    if hvd.rank() == 0:
        print(f"Final test accuracy: {final:.4f} ({hvd.size()} ranks)")


if __name__ == "__main__":
    main()
