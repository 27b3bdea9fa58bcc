"""Pipeline parallelism with hvdplus: a deep MLP on scikit-learn's digits, cut into stages over the ranks.

    hvdplusrun -np 2 python examples/pytorch_pipeline.py --check                          # 1 pipeline of 2 stages
    mpirun -np 4 --oversubscribe python examples/pytorch_pipeline.py --schedule zero-bubble  # 2 pipelines x 2 stages

With 4 ranks and 2 stages, ranks 0-1 hold the first stage of replicas 0 and 1, ranks 2-3 the second; each
replica trains on its share of every global batch and DistributedOptimizer averages a stage's gradients over
its replicas. Rank 0 prints the loss and the throughput per epoch, then the test accuracy. With --check it also
trains the unpipelined model in one process (same seed, whole global batch, same data order) and prints both
final losses: they agree to float32 rounding (the pipeline sums micro-batches in another order).
"""

import argparse
import copy
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdplus.torch as hvd


def deep_mlp(depth: int = 10, width: int = 128) -> torch.nn.Sequential:
    """64 pixels -> `depth` Linear+Tanh blocks -> 10 classes; the Pipeline cuts it between blocks."""
    blocks = []
    for i in range(depth):
        linear = torch.nn.Linear(64 if i == 0 else width, width)
        torch.nn.init.xavier_normal_(linear.weight, gain=5 / 3)  # keeps the signal alive through 10 Tanh layers
        torch.nn.init.zeros_(linear.bias)
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def batches(count: int, batch_size: int, epoch: int) -> list[torch.Tensor]:
    """The global batches of an epoch (the same on every rank and for the unpipelined model)."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(epoch))
    return [order[start : start + batch_size] for start in range(0, count - batch_size + 1, batch_size)]


def train_unpipelined(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> float:
    """Train `model` in this process on whole global batches; return the last epoch's mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        losses = []
        for batch in batches(len(x), args.batch_size, epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    return torch.stack(losses).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zero-bubble"])
    parser.add_argument("--stages", type=int, default=None, help="default: the job's size if <= 2, else 2")
    parser.add_argument("--micro-batches", type=int, default=8, help="per replica's batch")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per rank; default 2 for interleaved, else 1 (2 with zero-bubble: ZB-V)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the replicas")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--check", action="store_true", help="also train the unpipelined model on rank 0")
    args = parser.parse_args()
    hvd.init()
    stages = args.stages or (hvd.size() if hvd.size() <= 2 else 2)
    virtual = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        torch.tensor(digits.data / 16.0, dtype=torch.float32),
        torch.tensor(digits.target),
        test_size=0.2,
        random_state=0,
    )
    torch.manual_seed(0)  # the same model on every rank: each keeps its stage's layers
    model = deep_mlp()
    reference = copy.deepcopy(model) if args.check and hvd.rank() == 0 else None
    pipe = hvd.pipeline.Pipeline(
        model, num_stages=stages, micro_batches=args.micro_batches, schedule=args.schedule, virtual_stages=virtual
    )
    if args.batch_size % pipe.replicas:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of the {pipe.replicas} replicas")
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=pipe.named_parameters(),
        process_set=pipe.data_parallel_set,
    )
    share = args.batch_size // pipe.replicas
    mine = slice(pipe.replica * share, (pipe.replica + 1) * share)
    if hvd.rank() == 0:
        print(
            f"{hvd.size()} ranks: {pipe.replicas} pipeline(s) x {stages} stages, schedule {args.schedule}, "
            f"{virtual} chunk(s) per rank, {args.micro_batches} micro-batches per replica batch of {share}",
            flush=True,
        )

    for epoch in range(args.epochs):
        started, losses = time.perf_counter(), []
        for batch in batches(len(x_train), args.batch_size, epoch):
            part = batch[mine]
            optimizer.zero_grad()
            losses.append(pipe.train_step(x_train[part], y_train[part], torch.nn.functional.cross_entropy))
            optimizer.step()
        # Every stage has its replica's batch losses; averaged over the replicas they are the global batches'.
        loss = (
            hvd.allreduce(torch.stack(losses), op=hvd.Average, name="epoch_losses", process_set=pipe.data_parallel_set)
            .mean()
            .item()
        )
        throughput = len(losses) * args.batch_size / (time.perf_counter() - started)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss:.4f}, {throughput:.0f} samples/s", flush=True)

    # Each replica evaluates its share of the test set; the last stages count the hits.
    test_share = -(-len(x_test) // pipe.replicas)
    ours = slice(pipe.replica * test_share, (pipe.replica + 1) * test_share)
    output = pipe.eval_step(x_test[ours])
    hits = (output.argmax(dim=1) == y_test[ours]).sum() if pipe.is_last_stage else torch.tensor(0)
    accuracy = hvd.allreduce(hits, op=hvd.Sum, name="test_hits").item() / len(x_test)
    if hvd.rank() == 0:
        if reference is not None:
            unpipelined = train_unpipelined(reference, x_train, y_train, args)
            print(f"final loss {loss:.6f} (unpipelined {unpipelined:.6f}, difference {abs(loss - unpipelined):.1e})")
        else:
            print(f"final loss {loss:.6f}")
        print(f"test accuracy {accuracy:.3f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
