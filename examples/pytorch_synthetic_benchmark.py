"""Horovod's PyTorch synthetic benchmark on hvdplus: training throughput on random images, per rank and in total.

    mpirun -np 2 --oversubscribe python examples/pytorch_synthetic_benchmark.py
    mpirun -np 2 --oversubscribe python examples/pytorch_synthetic_benchmark.py --fp16-allreduce --model resnet18

On a GPU machine each rank trains on GPU `local_rank` (as Horovod's example does) unless --no-cuda is given.

The default model is a small built-in CNN; with torchvision installed, --model takes any torchvision model name.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import hvdplus.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--model", default="small_cnn", help="small_cnn, or a torchvision model name")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches")
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration"
    )
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--use-adasum", action="store_true", help="use the Adasum algorithm for the reduction")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU even where there is a GPU")
    return parser.parse_args()


def small_cnn(num_classes: int = 1000) -> torch.nn.Module:
    """Three conv-BN-ReLU stages and a linear head: a CPU-sized stand-in for ResNet-50."""
    layers: list[torch.nn.Module] = []
    channels = 3
    for width in (32, 64, 128):
        layers += [
            torch.nn.Conv2d(channels, width, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        ]
        channels = width
    return torch.nn.Sequential(
        *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, num_classes)
    )


def make_model(name: str) -> torch.nn.Module:
    if name == "small_cnn":
        return small_cnn()
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(
            f"--model {name} needs torchvision (pip install torchvision); the default is small_cnn"
        ) from None
    return getattr(models, name)()


def log(text: str, is_root: bool) -> None:
    if is_root:
        print(text, flush=True)


def main() -> None:
    args = parse_args()
    hvd.init()
    root, ranks = hvd.rank() == 0, hvd.size()  # asked once: local calls fail once a peer has shut down
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:  # one GPU per rank, as in Horovod's GPU examples
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(hvd.rank())
    model = make_model(args.model).to(device)
    lr_scaler = 1 if args.use_adasum else ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def run_batches(count: int) -> float:
        """Seconds for `count` steps, the GPU's queue drained at the end (its kernels run asynchronously)."""
        start = time.perf_counter()
        for _ in range(count):
            benchmark_step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    log(f"Model: {args.model}", root)
    log(f"Batch size: {args.batch_size}", root)
    kind = "GPU" if cuda else "CPU"
    log(f"Number of {kind}s: {ranks}", root)
    log("Running warmup...", root)
    run_batches(args.num_warmup_batches)
    log("Running benchmark...", root)
    img_secs = []
    for iteration in range(args.num_iters):
        seconds = run_batches(args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {img_sec:.1f} img/sec per {kind}", root)
        img_secs.append(img_sec)
    mean, confidence = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {kind}: {mean:.1f} +-{confidence:.1f}", root)
    log(f"Total img/sec on {ranks} {kind}(s): {ranks * mean:.1f} +-{ranks * confidence:.1f}", root)
    hvd.shutdown()


if __name__ == "__main__":
    main()
