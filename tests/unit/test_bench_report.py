"""scripts/bench_report.py: tables, plots and "not measured yet" sections from the benchmarks' JSON files.

The JSON files are made by the benchmarks' own summarising and writing functions from made-up timings, so a
change in a benchmark's format that the report does not follow fails here.
"""

import argparse
import dataclasses
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MIB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = (
    "## Allreduce against the raw engine call",
    "## Multi-host allreduce against the cost model",
    "## Training throughput, PyTorch",
    "## Framework overhead per step",
    "## Training throughput, Keras",
    "## ZeRO optimizer-state sharding",
    "## ZeRO-3 parameter sharding against FSDP2",
    "## Pipeline schedules",
    "## Elastic training",
    "## ZeRO and offload on one GPU against FSDP2",
)


@pytest.fixture
def scripts(monkeypatch):
    """The benchmark scripts as modules (they import each other by their plain names)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    names = (
        "bench_report",
        "bench_collectives",
        "bench_training",
        "bench_training_keras",
        "training_bench",
        "bench_multihost",
        "bench_zero",
        "bench_zero3",
        "bench_pipeline",
        "bench_overhead",
        "bench_zero_gpu",
    )
    return SimpleNamespace(**{name: importlib.import_module(name) for name in names})


def engine_report(bc, engine: str, ranks: int, hvdplus_s: float) -> dict:
    """One configuration as bench_collectives.py's driver keeps it; the quiet raw call takes 1 ms everywhere,
    so the busbw ratio and the fusion speedup are 1 ms / hvdplus_s."""
    plans = bc.make_plans(quick=True)
    times = {bc.HVDPLUS: hvdplus_s, bc.QUIET: 1e-3, bc.BESIDE: 1e-3, bc.ASYNC: 4e-3, bc.GROUPED: 0.5e-3}
    samples = {(side, plan): [seconds] * 3 for side, seconds in times.items() for plan in plans}
    report = bc.EngineReport(engine, ranks)
    bc.fill_report(report, samples, plans, rounds=1, rank=1)
    result = dataclasses.asdict(report)
    result["job_wall_s"], result["summary"] = 1.0, bc.summarize(result)
    return result


def write_collectives(scripts, path: Path) -> None:
    bc = scripts.bench_collectives
    reports = {
        bc.config_label("mpi", 2): engine_report(bc, "mpi", 2, 2e-3),
        bc.config_label("gloo", 3): engine_report(bc, "gloo", 3, 4e-3),
    }
    bc.write_json(
        str(path),
        argparse.Namespace(np=(2, 3), quick=True),
        reports,
        {bc.config_label("mpi", 3): "the mpi benchmark job failed (exit codes [1])"},
    )


def training_args(path: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(
        json=str(path),
        np=2,
        models="mlp",
        steps=20,
        reps=3,
        warmup=5,
        rounds=2,
        timeout=600,
        worker=False,
        mode=None,
        result_file=None,
        **extra,
    )


def write_training(scripts, path: Path) -> None:
    samples = {"ddp": {"mlp": [0.040] * 3}, "hvdplus": {"mlp": [0.032] * 3}, "hvdplus_fp16": {"mlp": [0.050] * 3}}
    summary = scripts.bench_training.summarize(samples, ("ddp", "hvdplus", "hvdplus_fp16"), 2)
    scripts.training_bench.write_report(training_args(path, framework="torch", engine="mpi"), summary, samples, 0.0)


def write_training_keras(scripts, path: Path) -> None:
    step = {"single": 0.015, "mwms": 0.040, "hvdplus": 0.026, "hvdplus_fp16": 0.035}
    samples = {mode: {"mlp": [seconds] * 3} for mode, seconds in step.items()}
    summary = scripts.bench_training_keras.summarize(samples, 2)
    scripts.training_bench.write_report(training_args(path), summary, samples, 0.0)


def write_multihost(scripts, path: Path) -> None:
    """One 2x2 run, as the workers record it, summarised and written as bench_multihost.py's driver does."""
    step = {
        "raw": (0.010, 0.700),
        "flat": (0.012, 0.600),
        "hierarchical": (0.015, 0.480),
        "hierarchical-fp16": (0.010, 0.240),
    }
    record = {
        "hosts": 2,
        "local": 2,
        "sizes": {"1M": 1 << 20, "64M": 1 << 26},
        "hierarchical_runs": {},
        "links": {"local": {"alpha_s": 2e-5, "beta_Bps": 2e9}, "inter": {"alpha_s": 1e-3, "beta_Bps": 1.2e8}},
        "samples": {mode: {"1M": [small], "64M": [large]} for mode, (small, large) in step.items()},
    }
    summary = scripts.bench_multihost._summarise([record], 1e9)
    autotune = {
        "shape": "mpi 2x2",
        "grid_steps_per_s": {"hier=0 fusion=0MiB cycle=0.5ms": 4.0, "hier=1 fusion=4MiB cycle=2.5ms": 5.0},
        "best_fixed": "hier=1 fusion=4MiB cycle=2.5ms",
        "autotune_steps_per_s": 4.9,
        "autotune_over_best": 0.98,
        "search_steps": 40,
        "search_s": 12.0,
        "chosen": {"fusion_threshold": 1},
    }
    path.write_text(
        json.dumps(
            {
                "rate": "1gbit",
                "rate_bps": 1e9,
                "summary": summary,
                "records": [record],
                "autotune": [autotune],
                "date": "2026-11-20",
            }
        )
    )


def write_zero3(scripts, path: Path) -> None:
    """bench_zero3.py's report at 2 ranks: stage 3 holds half of DistributedOptimizer's model state; one process
    was OOM-killed under the limit and stage 3 trained."""

    def job(state_mib: int, rss_mib: int, step_s: float, sent_mib: int) -> list[dict]:
        return [
            {
                "rank": rank,
                "params": 168_000_000,
                "step_s": [step_s] * 3,
                "sent_bytes": [sent_mib * MIB] * 3,
                "peak_rss_bytes": rss_mib * MIB,
                "param_bytes": state_mib * MIB // 4,
                "grad_bytes": state_mib * MIB // 4,
                "state_bytes": state_mib * MIB // 2,
            }
            for rank in (0, 1)
        ]

    samples = {
        "zero3": [job(1344, 2300, 5.5, 929)],
        "fsdp2": [job(1344, 2500, 9.5, 1249)],
        "zero": [job(1680, 2400, 5.6, 641)],
        "distributed": [job(2688, 4000, 6.6, 1282)],
    }
    args = argparse.Namespace(np=2, layers=12, steps=3, rounds=1)
    report = scripts.bench_zero3.build_report(args, samples)
    report["memory_limit"] = {
        "limit_bytes": 2645 * MIB,
        "single_exit_codes": [-9],
        "zero3_exit_codes": [0],
        "zero3_peak_rss_bytes": [2300 * MIB, 2310 * MIB],
        "zero3_step_s": 5.6,
    }
    path.write_text(json.dumps(report))


def write_zero(scripts, path: Path) -> None:
    """bench_zero.py's report at 2 ranks: DistributedOptimizer 384 MiB of state, ZeroOptimizer half of it."""

    def job(state_mib: int, rss_mib: int, step_s: float) -> list[dict]:
        rank = {
            "params": 50_000_000,
            "state_bytes": state_mib * MIB,
            "peak_rss_bytes": rss_mib * MIB,
            "step_s": [step_s] * 3,
        }
        return [rank, rank]

    samples = {"distributed": [job(384, 1200, 0.600)], "zero": [job(192, 1000, 0.660)]}
    report = {
        "params": 50_000_000,
        "width": 2048,
        "batch": 16,
        "rounds": 1,
        "ranks": {2: scripts.bench_zero.summarize(samples, 2)},
    }
    path.write_text(json.dumps(report))


def write_elastic(scripts, path: Path) -> None:
    """bench_elastic.py's summary rows (one with a target and a reference) and the scale-up's phases."""
    report = {
        "date": "2026-11-25T14:00:00",
        "host": "testhost",
        "cpus": 2,
        "summary": [
            {
                "metric": "recovery after a SIGKILL, median",
                "value": 0.19,
                "unit": "s",
                "target": 3.0,
                "reference": 30.4,
                "reference_name": "Horovod Elastic",
            },
            {"metric": "TorchState.save() / torch copy", "value": 1.02, "unit": "x", "target": 1.5},
        ],
        "scaleup": {"median_phases_s": {"imported": 3.5, "synced": 0.17}},
    }
    path.write_text(json.dumps(report))


def pipeline_row(schedule: str, bubble: float, theory: float) -> dict:
    """A bench_pipeline.py row at S = 2, M = 4, with what the report and the plot read."""
    return {
        "schedule": schedule,
        "stages": 2,
        "micro_batches": 4,
        "layers": "real",
        "bubble": [bubble, bubble],
        "bubble_mean": bubble,
        "bubble_max": bubble,
        "simulated_mean": theory,
        "theory": theory,
        "peak_saved_bytes": [10240 * 1024, 10240 * 1024],
    }


def write_pipeline(scripts, path: Path) -> None:
    rows = [pipeline_row("1f1b", 0.21, 0.2), pipeline_row("zb-h1", 0.05, 0.077)]
    scripts.bench_pipeline.judge(rows)
    compare = {
        "ranks": 2,
        "layers": 8,
        "width": 2048,
        "batch": 64,
        "micro_batches": 8,
        "rounds": 1,
        "step_s": {},
        "step_s_median": {"pipeline": 0.7, "data-parallel": 0.28},
        "ratio": 2.5,
    }
    path.write_text(
        json.dumps(
            {
                "date": "2026-11-21T10:00:00",
                "host": "testhost",
                "cpus": 2,
                "wall_s": 1.0,
                "args": {"real_stages": "2", "sleep_ms": 5.0, "rounds": 1},
                "rows": rows,
                "compare": compare,
            }
        )
    )


def run_report(scripts, results: Path, tmp_path: Path) -> str:
    out = tmp_path / "docs" / "performance.md"
    assert scripts.bench_report.main(["--results", str(results), "--out", str(out)]) == 0
    return out.read_text()


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, path


def write_overhead(scripts, path: Path) -> None:
    """bench_overhead.py's report from made-up medians: one process 3 ms, raw MPI 0.5 ms, raw Gloo 1 ms."""
    steps = {
        "single": 3e-3,
        "raw_mpi": 0.5e-3,
        "raw_gloo": 1e-3,
        "ddp": 5e-3,
        "hvdplus_mpi": 4e-3,
        "hvdplus_gloo": 5e-3,
    }
    args = argparse.Namespace(np=2, rounds=1, reps=1, steps=1, warmup=0, timeout=1, json=str(path), worker=False)
    path.write_text(json.dumps(scripts.bench_overhead.summarize({k: [v] for k, v in steps.items()}, args)))


def write_zero_gpu(scripts, path: Path) -> None:
    """bench_zero_gpu.py's report: its speed rows from made-up step times (zero3 0.9x FSDP2, offloaded 0.8x)."""
    steps = {"plain": [0.1], "distributed": [0.104], "zero3": [0.18], "fsdp2": [0.2], "zero3_opt": [0.4]}
    steps["fsdp2_offload"] = [0.5]
    doc = {
        "date": "2026-11-28",
        "device": "NVIDIA H100 80GB HBM3",
        "cap_gib": 16.0,
        "batch_tokens": 2048,
        "checkpoint": True,
        "largest": {
            "distributed": {"params": 168_000_000, "layers": 8, "width": 1024},
            "zero3_params": {"params": 1_700_000_000, "layers": 32, "width": 2048},
            "zero": None,
        },
        "speed": scripts.bench_zero_gpu.summarize_speed({**steps, "zero": []}, {"zero"}, 2048),
        "ranks": {"distributed": [3 * MIB * 1024, 3 * MIB * 1024], "zero3": [MIB * 1024, None]},
    }
    path.write_text(json.dumps(doc))


def test_every_benchmark_gets_its_tables_and_plots(scripts, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, write in (
        ("bench_collectives", write_collectives),
        ("bench_training", write_training),
        ("bench_training_keras", write_training_keras),
        ("bench_multihost", write_multihost),
        ("bench_zero", write_zero),
        ("bench_zero3", write_zero3),
        ("bench_pipeline", write_pipeline),
        ("bench_elastic", write_elastic),
        ("bench_overhead", write_overhead),
        ("bench_zero_gpu", write_zero_gpu),
    ):
        write(scripts, results / f"{name}.json")
    text = run_report(scripts, results, tmp_path)

    assert [line for line in text.splitlines() if line.startswith("## ")] == list(SECTIONS)
    assert "Not measured yet" not in text
    # collectives: busbw ratio 1 ms / hvdplus time per size, fusion speedup, per-tensor ratios, the failure
    assert "| busbw ratio hvdplus / quiet raw | 4 KiB | 64 KiB | 1 MiB | 100 x 4 KiB async (raw / hvdplus) |" in text
    assert "| MPI, 2 ranks, in place | 0.50 | 0.50 | 0.50 | 0.50x (hvdplus 2.00 ms, raw 1.00 ms) |" in text
    assert "| Gloo, 3 ranks, new output | 0.25 | 0.25 | 0.25 |  |" in text
    assert "| 16 | 0.25 / 2.00 | 0.25 / 2.00 |" in text
    assert "- mpi np=3: failed: the mpi benchmark job failed (exit codes [1])" in text
    # training: step time, throughput and its ratio to DDP; Keras's step-time ratios to MWMS and one process
    assert "| mlp | hvdplus | 32.0 | 32.0-32.0 | 2000 | 1.25x |" in text
    assert "| mlp | hvdplus | 26.0 | 26.0-26.0 | 2462 | 0.65x | 1.73x |" in text
    # overhead: step minus one process minus the raw allreduce, against DDP's
    assert "| hvdplus_mpi | 4.00 | 0.50 | 0.50 |" in text
    assert "| ddp | 5.00 | 1.00 | 1.00 |" in text
    # multi-host: measured and predicted per size, and the ratios
    assert "| 64M | 700 | 600 | 480 | 240 |" in text
    assert "| 64M | 0.80 | 0.50 | 1.12 |" in text
    assert "0.98x the best fixed setting (`hier=1 fusion=4MiB cycle=2.5ms`)" in text
    assert "| hier=1 fusion=4MiB cycle=2.5ms | 5.00 |" in text
    assert "Measured 2026-11-20 on simulated hosts, 1gbit link." in text
    # ZeRO: the README's table; its JSON has no date or machine
    assert (
        "| 2 | ZeroOptimizer | 192 MiB (0.500x; target <= 0.510x) | 1000 MiB (-200 MiB; target -154 MiB) | "
        "660 ms (1.10x; target <= 1.10x) |"
    ) in text
    assert "(file time); the JSON records no machine." in text
    # ZeRO-3: the four configurations with stage 3's ratios, the model-state verdict and the memory-limit run
    assert (
        "| stage 3 (hvd.shard_parameters) | 2300 MiB | 336 MiB | 336 MiB | 672 MiB | 929 MiB | 5.50 s (0.58x "
        "FSDP2's, target <= 0.6; 0.98x stage 2's, target <= 1.25) |"
    ) in text
    assert "| FSDP2 (fully_shard, Gloo) | 2500 MiB | 336 MiB | 336 MiB | 672 MiB | 1249 MiB | 9.50 s |" in text
    assert "Stage 3's resident model state is 0.500x DistributedOptimizer's" in text
    assert ": met); its peak RSS is below FSDP2's." in text
    assert (
        "one process training the model with plain AdamW is killed by the OOM killer; stage 3 at 2 ranks trains "
        "(peak RSS 2300, 2310 MiB, step 5.60 s)"
    ) in text
    # pipeline: measured / theory, stage 0's activations, the verdicts; the step-time comparison
    assert "| 1F1B | 2 | 0.210 / 0.200 | 10240 | M=4 PASS 1.0 pp |" in text
    assert "| ZB-H1 | 2 | 0.050 / 0.077 | 10240 | M=4 PASS 0.24x, mem 1.00x |" in text
    assert "| pipeline / data-parallel | 2.50x |" in text
    assert "Measured 2026-11-21T10:00:00 on host testhost, 2 CPUs." in text
    # elastic: the summary with its target and reference, the scale-up phases by bench_elastic.py's names
    assert "| recovery after a SIGKILL, median | 0.19 s (target <= 3; Horovod Elastic: 30.40 s) |" in text
    assert "| TorchState.save() / torch copy | 1.02x (target <= 1.5) |" in text
    assert "| imports (torch, hvdplus.torch): -> new workers imported (the old ones train on) | 3.500 |" in text
    # ZeRO on a GPU: the largest model against DistributedOptimizer's, each step against its anchor
    assert "On NVIDIA H100 80GB HBM3, GPU memory capped at 16 GiB, 2048 tokens a step" in text
    assert "| zero3_params | 1700.0M (32 x 2048) | 10.12 |" in text
    assert "| zero | out of memory at the smallest |" in text
    assert "| zero3 | 180 | 11,378 | 0.90 fsdp2, 1.73 distributed |" in text
    assert "| zero3_opt | 400 | 5,120 | 0.80 fsdp2_offload |" in text
    assert "| zero | out of memory |  |  |" in text
    assert "| zero3 | 1,024 MiB, - |" in text

    images = (
        "collectives_busbw",
        "collectives_per_tensor",
        "multihost",
        "training",
        "training_keras",
        "zero",
        "zero3",
        "pipeline",
    )
    for name in images:
        assert f"](img/{name}.png)" in text
        assert_png(tmp_path / "docs" / "img" / f"{name}.png")


def test_missing_files_say_not_measured_yet_with_their_command(scripts, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write_zero(scripts, results / "bench_zero.json")
    text = run_report(scripts, results, tmp_path)

    assert [line for line in text.splitlines() if line.startswith("## ")] == list(SECTIONS)
    for bench in scripts.bench_report.BENCHMARKS:
        if bench.filename == "bench_zero.json":
            assert f"Reproduce: `{bench.command}`" in text
        else:
            assert f"Not measured yet: `{bench.command}` writes `{bench.filename}`." in text
    assert text.count("not measured yet |") == len(scripts.bench_report.BENCHMARKS) - 1
    assert [path.name for path in (tmp_path / "docs" / "img").iterdir()] == ["zero.png"]


def test_a_table_cell_keeps_a_pipe_inside_it(scripts):
    assert scripts.bench_report.table(["a", "b"], [["|x|", 1]]) == ["| a | b |", "|---|---|", "| \\|x\\| | 1 |", ""]
