"""ZeRO 1-3 and offload on one GPU against FSDP2, DistributedOptimizer and plain torch: the largest GPT each trains
under a GPU memory cap, the step time at a common size, and GPU memory per rank at 2 ranks sharing the GPU.

    python scripts/bench_zero_gpu.py                         # every part, 16 GiB cap (a 16 GiB card)
    python scripts/bench_zero_gpu.py --parts speed --layers 8 --width 1024
    python scripts/bench_zero_gpu.py --smoke                 # the plumbing on CPU tensors (no GPU), tiny sizes

The model is scripts/bench_zero3.py's GPT (pre-norm TransformerEncoderLayers, heads of 64, untied head), bf16
compute, fp32 master parameters, AdamW; batch --batch x --seq tokens. Every configuration runs in its own process
(an out-of-memory error leaves nothing behind), in alternating order over --rounds. Modes:

    plain            torch only (autocast bf16, fused AdamW)
    distributed      hvd.DistributedOptimizer
    zero             hvd.ZeroOptimizer (stage 2)
    zero3            hvd.shard_parameters(param_dtype=bf16, reduce_dtype=fp32) + ZeroOptimizer, built on meta
    zero3_opt        zero3 with ZeroOptimizer(offload="optimizer")
    zero3_params     zero3 with shard_parameters(offload="parameters") and the optimizer offloaded
    fsdp2            fully_shard per layer and root, MixedPrecisionPolicy(bf16, fp32)
    fsdp2_offload    fsdp2 with CPUOffloadPolicy(pin_memory=True)

--checkpoint (on by default) recomputes each layer's activations in backward: shard_parameters'
checkpoint_activations=True, and checkpoint_wrapper for FSDP2, so both sides carry the same activations.

Parts: `largest` doubles --layers from 2 at each --widths until a mode runs out of memory under the cap (each try
two steps); `speed` times every mode at --layers x --width (median of --steps steps after --warmup) and prints
each ratio to its anchor (zero3 and zero3_opt to fsdp2 and fsdp2_offload, zero3 to distributed, distributed to
plain); `ranks` runs distributed, zero and zero3 at 2 ranks on one GPU (HOROVOD_GPU_OPERATIONS=gloo) and prints
each rank's peak GPU memory. Writes results/bench_zero_gpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import wait_all  # noqa: E402
from bench_zero3 import build_model  # noqa: E402
from training_bench import start_gloo_job  # noqa: E402

HVDPLUS_MODES = ("distributed", "zero", "zero3", "zero3_opt", "zero3_params")
MODES = ("plain", *HVDPLUS_MODES, "fsdp2", "fsdp2_offload")
ANCHORS = {"zero3": "fsdp2", "zero3_opt": "fsdp2_offload", "distributed": "plain"}
GIB = 1 << 30


# ============================================================================ inside a job
def worker(args: argparse.Namespace) -> None:
    """Build `args.mode`'s model and optimizer, train --warmup + --steps steps, write rank 0's result."""
    import torch

    device, rank, size, hvd = setup(args)
    result: dict[str, Any] = {"mode": args.mode, "rank": rank, "oom": False}
    try:
        model, optimizer, params = build(args, device, hvd)
        result["params"] = params
        result["step_s"] = train(args, model, optimizer, device)
    except torch.OutOfMemoryError as error:
        result.update(oom=True, error=str(error).splitlines()[0])
    if device.type == "cuda":
        result["max_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    everyone = gather(result, hvd)
    if rank == 0:
        Path(args.result_file).write_text(json.dumps(everyone))


def setup(args: argparse.Namespace) -> tuple[Any, int, int, Any]:
    """(device, rank, size, hvdplus.torch or None): the GPU capped to --cap-gib, and the mode's runtime."""
    import torch

    if args.smoke:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("HOROVOD_LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
    if args.mode.startswith("fsdp2"):
        import torch.distributed as dist

        dist.init_process_group("gloo" if args.smoke else "nccl", rank=0, world_size=1, init_method=args.init_method)
        return device, 0, 1, None
    if args.mode == "plain":
        return device, 0, 1, None
    import hvdplus.torch as hvd

    hvd.init()
    return device, hvd.rank(), hvd.size(), hvd


def build(args: argparse.Namespace, device: Any, hvd: Any) -> tuple[Any, Any, int]:
    """The mode's model on `device` and its optimizer; the number of parameters."""
    import torch

    layer_type = torch.nn.TransformerEncoderLayer
    if args.mode.startswith("zero3"):
        model = build_model(args.layers, meta=True, width=args.width, vocab=args.vocab)
        params = sum(p.numel() for p in model.parameters())
        hvd.shard_parameters(
            model,
            units=[layer_type],
            device=device,
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            offload="parameters" if args.mode == "zero3_params" else None,
            checkpoint_activations=args.checkpoint,
        )
        optimizer = hvd.ZeroOptimizer(
            adamw(model, device, host=args.mode != "zero3"),
            named_parameters=model.named_parameters(),
            offload=None if args.mode == "zero3" else "optimizer",
        )
        return model, optimizer, params
    model = build_model(args.layers, width=args.width, vocab=args.vocab)
    params = sum(p.numel() for p in model.parameters())
    if args.mode.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if args.mode == "fsdp2_offload":
            policy["offload_policy"] = CPUOffloadPolicy(pin_memory=not args.smoke)
        else:
            model = model.to(device)
        if args.checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, layer in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(layer)
        for layer in model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        return model, adamw(model, device, host=args.mode == "fsdp2_offload"), params
    model = model.to(device)
    if args.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    optimizer = adamw(model, device, host=False)
    if args.mode == "distributed":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif args.mode == "zero":
        optimizer = hvd.ZeroOptimizer(optimizer, named_parameters=model.named_parameters())
    return model, optimizer, params


def adamw(model: Any, device: Any, host: bool) -> Any:
    """Fused AdamW: on the GPU, or torch's fused CPU kernel for an optimizer stepped in host memory."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=host or device.type == "cuda")


def train(args: argparse.Namespace, model: Any, optimizer: Any, device: Any) -> list[float]:
    """Seconds of each step after the warm-up (the GPU's work included: synchronised at each step's end)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    return times


def gather(result: dict[str, Any], hvd: Any) -> list[dict[str, Any]]:
    if hvd is None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return [result]
    everyone = hvd.allgather_object(result)
    hvd.shutdown()
    return everyone


# ============================================================================ the driver
def run(args: argparse.Namespace, mode: str, layers: int, width: int, ranks: int = 1) -> list[dict[str, Any]]:
    """One job of `mode`: each rank's result."""
    with tempfile.TemporaryDirectory() as workdir:
        result_file = os.path.join(workdir, "result.json")
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--mode",
            mode,
            "--layers",
            str(layers),
            "--width",
            str(width),
            "--result-file",
            result_file,
            "--init-method",
            f"file://{workdir}/fsdp",
            *(
                option
                for name in ("batch", "seq", "vocab", "steps", "warmup", "cap_gib")
                for option in _flag(args, name)
            ),
            *(["--smoke"] if args.smoke else []),
            *([] if args.checkpoint else ["--no-checkpoint"]),
        ]
        env = {"HOROVOD_GPU_OPERATIONS": "gloo"} if ranks > 1 else {}
        if args.smoke:
            env["HVDPLUS_DEVICE_PATH_ON_CPU"] = "1"
        codes = wait_all(start_gloo_job(ranks, command, env, workdir), args.timeout)
        if not os.path.exists(result_file):
            raise RuntimeError(f"the {mode} job ({layers} layers, width {width}) failed: exit codes {codes}")
        return json.loads(Path(result_file).read_text())


def _flag(args: argparse.Namespace, name: str) -> list[str]:
    return [f"--{name.replace('_', '-')}", str(getattr(args, name))]


def largest(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    """Per mode: the largest model (parameters) that trained two steps under the cap, over --widths."""
    found: dict[str, Any] = {}
    for mode in modes:
        best = None
        for width in args.widths:
            layers = 2
            while layers <= args.max_layers:
                result = run(args, mode, layers, width)[0]
                print(f"  {mode:14s} width {width:5d} layers {layers:4d}: {'OOM' if result['oom'] else 'ok'}")
                if result["oom"]:
                    break
                if best is None or result["params"] > best["params"]:
                    best = {"params": result["params"], "layers": layers, "width": width}
                layers *= 2
        found[mode] = best
    return found


def speed(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    """Per mode at --layers x --width: median step seconds and tokens/s, over --rounds alternating rounds."""
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    oom: set[str] = set()
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            result = run(args, mode, args.layers, args.width)[0]
            if result["oom"]:
                oom.add(mode)
            else:
                samples[mode].extend(result["step_s"])
    return summarize_speed(samples, oom, args.batch * args.seq)


def summarize_speed(samples: dict[str, list[float]], oom: set[str], tokens: int) -> dict[str, Any]:
    """Per mode: the median step and tokens/s (or out of memory), and each ratio to its anchor."""
    rows: dict[str, Any] = {}
    for mode, times in samples.items():
        if mode in oom or not times:
            rows[mode] = {"oom": True}
            continue
        step = statistics.median(times)
        rows[mode] = {"step_s": step, "tokens_per_s": tokens / step}
    for mode, anchor in ANCHORS.items():
        if "step_s" in rows.get(mode, {}) and "step_s" in rows.get(anchor, {}):
            rows[mode][f"ratio_to_{anchor}"] = rows[mode]["step_s"] / rows[anchor]["step_s"]
    if "step_s" in rows.get("zero3", {}) and "step_s" in rows.get("distributed", {}):
        rows["zero3"]["ratio_to_distributed"] = rows["zero3"]["step_s"] / rows["distributed"]["step_s"]
    return rows


def ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Peak GPU memory of each of 2 ranks sharing the GPU, per mode, against DistributedOptimizer's."""
    rows = {}
    for mode in ("distributed", "zero", "zero3"):
        results = run(args, mode, args.layers, args.width, ranks=2)
        rows[mode] = [r.get("max_memory_bytes") for r in sorted(results, key=lambda r: r["rank"])]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", nargs="+", default=["largest", "speed", "ranks"], choices=["largest", "speed", "ranks"]
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--cap-gib", type=float, default=16.0, help="GPU memory cap per process (GiB)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--max-layers", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    parser.add_argument("--smoke", action="store_true", help="CPU tensors on the simulated device plane, tiny sizes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--init-method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    modes = list(args.modes)
    if args.smoke:  # sizes that run in seconds; CPUOffloadPolicy needs a GPU
        args.widths, args.width, args.layers, args.max_layers = [64], 64, 2, 4
        args.vocab, args.batch, args.seq, args.steps, args.warmup, args.rounds = 256, 2, 16, 2, 1, 1
        modes = [mode for mode in modes if mode != "fsdp2_offload"]
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (--smoke runs the plumbing on CPU tensors)")
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": "cpu (smoke)" if args.smoke else __import__("torch").cuda.get_device_name(0),
        "cap_gib": args.cap_gib,
        "batch_tokens": args.batch * args.seq,
        "checkpoint": args.checkpoint,
    }
    if "largest" in args.parts:
        report["largest"] = largest(args, modes)
        anchor = (report["largest"].get("distributed") or {}).get("params")
        for mode, best in report["largest"].items():
            ratio = f"  ({best['params'] / anchor:.1f}x distributed)" if best and anchor else ""
            print(f"largest {mode:14s}: {best}{ratio}")
    if "speed" in args.parts:
        report["speed"] = speed(args, modes)
        for mode, row in report["speed"].items():
            print(f"speed {mode:14s}: {row}")
    if "ranks" in args.parts:
        report["ranks"] = ranks(args)
        for mode, peaks in report["ranks"].items():
            print(f"2 ranks {mode:12s}: peak GPU memory per rank {peaks}")
    out = (
        Path(__file__).resolve().parents[1]
        / "results"
        / ("bench_zero_gpu_smoke.json" if args.smoke else "bench_zero_gpu.json")
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
