"""Turn the benchmarks' JSON files into PNG plots and docs/performance.md, with the tables and the plots.

    python scripts/bench_report.py                                   # results/ -> docs/performance.md
    python scripts/bench_report.py --results DIR --out docs/performance.md

Reads, from --results (default `results/`), what the benchmarks write; every file is optional, and a missing
one gets a short section that says "not measured yet" and gives the command that writes it:

    bench_collectives.json     scripts/bench_collectives.py: allreduce busbw per size, hvdplus against the quiet
                               raw engine call, per engine and rank count; fusion; per-tensor cost against N
    bench_multihost.json       scripts/bench_multihost.py: time per mode on simulated hosts against the cost model
    bench_training.json        scripts/bench_training.py: training step time and throughput per model and mode
    bench_training_keras.json  scripts/bench_training_keras.py: the same for Keras against MWMS
    bench_zero.json            scripts/bench_zero.py: ZeroOptimizer's state, peak RSS and step time
    bench_zero3.json           scripts/bench_zero3.py: ZeRO-3 against FSDP2, stage 2 and DistributedOptimizer
    bench_pipeline.json        scripts/bench_pipeline.py: each schedule's bubble against theory
    bench_elastic.json         scripts/bench_elastic.py: recovery, scale-up, commit cost and state sync
    bench_zero_gpu.json        scripts/bench_zero_gpu.py: ZeRO 1-3 and offload on one GPU against FSDP2

The tables are generated from the JSON, so they always match it. The plots (matplotlib, the optional `bench`
extra, Agg backend) go to img/ beside the markdown file, one PNG per figure. Each section also says when the
numbers were measured (the JSON's date, else the file's modification time) and on what machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import config_label, fmt_size, plot_sweep  # noqa: E402
from bench_elastic import SCALEUP_PHASES  # noqa: E402
from bench_pipeline import BUBBLE_TOLERANCE, ZB_BUBBLE_RATIO, ZB_MEMORY_RATIO  # noqa: E402
from bench_pipeline import plot as plot_pipeline  # noqa: E402

Doc = dict[str, Any]
MIB = 1 << 20
ENGINE_NAMES = {"mpi": "MPI", "gloo": "Gloo"}
OPTIMIZER_NAMES = {"distributed": "DistributedOptimizer", "zero": "ZeroOptimizer"}
SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "interleaved (v=2)",
    "zb-h1": "ZB-H1",
    "zb-v": "ZB-V",
}
PREDICTIONS = {"ring": "ring", "recursive_doubling": "recursive doubling", "hierarchical": "hierarchical"}


# ============================================================================ markdown and figures
def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table; a '|' inside a cell is escaped so that the cell stays one cell."""

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows), ""]


def ms(seconds: float) -> str:
    """Milliseconds: to 0.01 below 10 ms, to 0.1 below 100 ms, whole above (never in exponent notation)."""
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ratio(value: float | None) -> str:
    """A ratio to two decimals, or "-" where the benchmark could not compute it."""
    return "-" if value is None else f"{value:.2f}"


def count(n: int, noun: str) -> str:
    """A count and its noun, plural unless the count is 1 ("1 round", "2 rounds")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclass(frozen=True)
class Figures:
    """Where the plots go: `img_dir`, which the markdown file links to as `link_dir`."""

    plt: Any
    img_dir: Path
    link_dir: str

    def path(self, name: str) -> Path:
        return self.img_dir / f"{name}.png"

    def link(self, name: str, alt: str) -> str:
        return f"![{alt}]({self.link_dir}/{name}.png)\n"

    def save(self, fig: Any, name: str, alt: str) -> str:
        """Write the figure as NAME.png, close it, and return its markdown image link."""
        fig.tight_layout()
        fig.savefig(self.path(name), dpi=110)
        self.plt.close(fig)
        return self.link(name, alt)


def load_pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display); matplotlib is the optional `bench` extra."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench_report.py needs matplotlib, hvdplus's optional 'bench' extra: "
            ".venv/bin/pip install -e '.[bench]' (or pip install 'matplotlib>=3.7')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax: Any, groups: Sequence[str], series: dict[str, Sequence[float]], fmt: str) -> None:
    """One cluster of bars per group, one bar per series in each, each bar labelled with its value."""
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        bars = ax.bar([g + offset for g in range(len(groups))], values, width, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize="small")
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(True, axis="y", alpha=0.3)


def log_size_axis(ax: Any, sizes: Sequence[int], labels: Sequence[str]) -> None:
    """A log2 x axis of message sizes, ticked at the measured sizes."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, labels)
    ax.set_xlabel("message size")


# ============================================================================ collectives
def pretty_config(report: Doc) -> str:
    """A configuration's name in the tables and plots, as the README writes it ("MPI, 2 ranks")."""
    return f"{ENGINE_NAMES.get(report['engine'], report['engine'])}, {report['np']} ranks"


def busbw_table(configs: dict[str, Doc]) -> list[str]:
    """Rows per configuration and mode: hvdplus busbw / quiet raw busbw per size, and the fusion speedup."""
    sizes = sorted({row["bytes"] for report in configs.values() for row in report["allreduce"]})
    rows = []
    for report in configs.values():
        fusion = report["fusion"]
        for index, mode in enumerate(dict.fromkeys(row["mode"] for row in report["allreduce"])):
            ratios = {row["bytes"]: row["ratio"] for row in report["allreduce"] if row["mode"] == mode}
            fused = (
                (
                    f"{fusion['speedup']:.2f}x (hvdplus {ms(fusion['hvdplus_time_s'])} ms, raw "
                    f"{ms(fusion['raw_time_s'])} ms)"
                )
                if index == 0 and fusion
                else ""
            )
            rows.append([f"{pretty_config(report)}, {mode}", *(ratio(ratios.get(s)) for s in sizes), fused])
    fusion = next((r["fusion"] for r in configs.values() if r["fusion"]), None)
    fusion_head = f"{fusion['tensors']} x {fmt_size(fusion['tensor_bytes'])} async (raw / hvdplus)" if fusion else ""
    return table(["busbw ratio hvdplus / quiet raw", *map(fmt_size, sizes), fusion_head], rows)


def sweep_table(configs: dict[str, Doc]) -> list[str]:
    """Rows per N: raw time / hvdplus time per tensor, async and grouped, per configuration."""
    swept = [report for report in configs.values() if report["sweep"]]
    counts = sorted({row["tensors"] for report in swept for row in report["sweep"]})
    nbytes = swept[0]["sweep"][0]["tensor_bytes"]
    cells = {
        (pretty_config(r), row["tensors"]): f"{row['raw_over_async']:.2f} / {row['raw_over_grouped']:.2f}"
        for r in swept
        for row in r["sweep"]
    }
    labels = [pretty_config(r) for r in swept]
    return table(
        [f"N x {fmt_size(nbytes)}", *(f"{label} async / grouped" for label in labels)],
        [[n, *(cells.get((label, n), "") for label in labels)] for n in counts],
    )


def busbw_figure(plt: Any, configs: dict[str, Doc]) -> Any:
    """busbw against message size, a subplot per configuration: hvdplus solid, quiet raw dashed, a colour per mode."""
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.5), sharey=True, squeeze=False)
    for ax, report in zip(axes[0], configs.values()):
        modes = dict.fromkeys(row["mode"] for row in report["allreduce"])
        for color, mode in zip(("C0", "C1", "C2"), modes):
            rows = sorted((row for row in report["allreduce"] if row["mode"] == mode), key=lambda r: r["bytes"])
            sizes = [row["bytes"] for row in rows]
            ax.plot(sizes, [row["hvdplus_busbw_GBps"] for row in rows], "-o", color=color, label=f"hvdplus, {mode}")
            ax.plot(
                sizes,
                [row["raw_busbw_GBps"] for row in rows],
                "--s",
                color=color,
                alpha=0.7,
                label=f"quiet raw, {mode}",
            )
        sizes = sorted({row["bytes"] for row in report["allreduce"]})
        log_size_axis(ax, sizes, [fmt_size(s) for s in sizes])
        ax.set_yscale("log")
        ax.set_title(pretty_config(report))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    fig.suptitle("allreduce bus bandwidth, float32 Sum (medians, slowest rank)")
    return fig


def render_collectives(doc: Doc, figures: Figures) -> list[str]:
    """bench_collectives.json: the failed configurations, busbw ratios and their plot, the per-tensor cost."""
    configs = doc["configurations"]
    lines = [
        f"busbw = {doc['busbw_definition']}. Ratios of hvdplus to the raw engine call timed while hvdplus is "
        "not running; above 1 favours hvdplus."
        + (" Run with `--quick` (sizes up to 1 MiB, few repetitions)." if doc.get("quick") else ""),
        "",
    ]
    failures = [f"- {label}: failed: {error}" for label, error in doc.get("failures", {}).items()]
    lines += (failures + [""]) if failures else []
    if not configs:
        return lines
    lines += busbw_table(configs)
    lines.append(
        figures.save(busbw_figure(figures.plt, configs), "collectives_busbw", "allreduce busbw against message size")
    )
    if any(report["sweep"] for report in configs.values()):
        lines += [
            "Per-tensor cost of a round of N small allreduces: raw time / hvdplus time per tensor, as N "
            "`allreduce_async_` calls and as one `grouped_allreduce_` (above 1 favours hvdplus).",
            "",
        ]
        lines += sweep_table(configs)
        engines = tuple(dict.fromkeys(report["engine"] for report in configs.values()))
        nps = tuple(sorted({report["np"] for report in configs.values()}))
        reports = {config_label(r["engine"], r["np"]): r for r in configs.values()}
        plot_sweep(figures.plt, str(figures.path("collectives_per_tensor")), engines, nps, reports)
        lines.append(figures.link("collectives_per_tensor", "per-tensor cost against N"))
    return lines


# ============================================================================ multi-host
def links_line(shape: str, data: Doc) -> str:
    """A shape's measured links, which the predictions are made from."""
    local, inter = data["links"]["local"], data["links"]["inter"]
    return (
        f"**{shape}**: {data['hosts']} hosts x {data['local']} ranks, {count(data['runs'], 'run')}. Local link "
        f"α {local['alpha_s'] * 1e6:.0f} µs, β {local['beta_Bps'] / 1e9:.2f} GB/s; inter-host link "
        f"α {inter['alpha_s'] * 1e6:.0f} µs, β {inter['beta_Bps'] / 1e6:.0f} MB/s (ping-pong)."
    )


def multihost_tables(data: Doc) -> list[str]:
    """Measured against predicted time per size, then the issue's ratios per size."""
    sizes = data["sizes"]
    modes = list(next(iter(sizes.values()))["measured_s"])
    measured = table(
        ["size", *(f"{mode} (ms)" for mode in modes), *(f"predicted {p} (ms)" for p in PREDICTIONS.values())],
        [
            [label, *(ms(row["measured_s"][m]) for m in modes), *(ms(row["predicted_s"][p]) for p in PREDICTIONS)]
            for label, row in sizes.items()
        ],
    )
    ratios = table(
        ["size", "hierarchical / flat", "hierarchical fp16 / best uncompressed", "inter-host link utilisation"],
        [
            [
                label,
                *(
                    ratio(row.get(key))
                    for key in ("hierarchical_over_flat", "fp16_over_uncompressed", "link_utilisation")
                ),
            ]
            for label, row in sizes.items()
        ],
    )
    return measured + ratios


def autotune_lines(tuned: Doc) -> list[str]:
    """One autotune run: its choice and rate against every fixed setting of the grid, best first."""
    grid = sorted(tuned["grid_steps_per_s"].items(), key=lambda item: -item[1])
    return [
        f"**Autotune, {tuned['shape']}**: {tuned['autotune_steps_per_s']:.2f} steps/s after "
        f"{tuned['search_steps']} steps ({tuned['search_s']:.0f} s) of search, choosing "
        f"`{tuned['chosen']}`: {tuned['autotune_over_best']:.2f}x the best fixed setting "
        f"(`{tuned['best_fixed']}`).",
        "",
        *table(["fixed setting", "steps/s"], [[name, f"{rate:.2f}"] for name, rate in grid]),
    ]


def multihost_figure(plt: Any, summary: Doc, rate: str) -> Any:
    """Time against message size, a subplot per shape: each measured mode solid, the cost model's curves dashed."""
    fig, axes = plt.subplots(1, len(summary), figsize=(6.5 * len(summary), 5.5), squeeze=False)
    for ax, (shape, data) in zip(axes[0], summary.items()):
        rows = sorted(data["sizes"].items(), key=lambda item: item[1]["bytes"])
        sizes = [row["bytes"] for _, row in rows]
        for mode in rows[0][1]["measured_s"]:
            ax.plot(sizes, [row["measured_s"][mode] * 1e3 for _, row in rows], "-o", label=mode)
        for (key, name), dashes in zip(PREDICTIONS.items(), ((6, 3), (6, 2, 1, 2), (2, 2))):
            ax.plot(
                sizes,
                [row["predicted_s"][key] * 1e3 for _, row in rows],
                color="black",
                dashes=dashes,
                label=f"predicted {name}",
            )
        log_size_axis(ax, sizes, [label for label, _ in rows])
        ax.set_yscale("log")
        ax.set_ylabel("time per allreduce (ms)")
        ax.set_title(f"{shape}: {data['hosts']} hosts x {data['local']} ranks, {rate} link")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    return fig


def render_multihost(doc: Doc, figures: Figures) -> list[str]:
    """bench_multihost.json's summary: per shape its links and tables, then one figure of every shape."""
    summary = doc["summary"]
    lines = [
        "Medians over rounds and runs, slowest rank, float32; raw = mpi4py `Allreduce` with hvdplus not "
        "running. Predicted: the cost model's formulas (scripts/bench_multihost.py) fed with the measured "
        "α and β. Targets of issue 14 (64 MB, 1 Gbit/s): hierarchical / flat <= 1.0 at 2x2 and <= 0.75 at "
        "2x4; fp16 / uncompressed <= 0.6; link utilisation >= 0.7; autotune / best fixed setting >= 0.95.",
        "",
    ]
    for shape, data in summary.items():
        lines += [links_line(shape, data), "", *multihost_tables(data)]
    for tuned in doc.get("autotune", []):
        lines += autotune_lines(tuned)
    lines.append(
        figures.save(
            multihost_figure(figures.plt, summary, doc["rate"]),
            "multihost",
            "allreduce time against message size, measured and predicted",
        )
    )
    return lines


# ============================================================================ training
def training_table(summary: Doc, ratio_columns: Sequence[tuple[str, str]]) -> list[str]:
    """One row per model and mode: step time, its quartiles, throughput and the given ratios."""
    rows = []
    for model, modes in summary.items():
        for mode, entry in modes.items():
            p25, p75 = entry["p25_p75_s"]
            rows.append(
                [
                    model,
                    mode,
                    ms(entry["step_time_s"]),
                    f"{ms(p25)}-{ms(p75)}",
                    f"{entry['samples_per_s']:.0f}",
                    *(f"{entry[key]:.2f}x" if key in entry else "" for _, key in ratio_columns),
                ]
            )
    return table(["model", "mode", "step (ms)", "p25-p75 (ms)", "samples/s", *(h for h, _ in ratio_columns)], rows)


def throughput_figure(plt: Any, summary: Doc, baseline: str, title: str) -> Any:
    """Bars of each other mode's throughput over the baseline mode's, a cluster per model."""
    models = list(summary)
    modes = [mode for mode in summary[models[0]] if mode != baseline]
    series = {
        mode: [summary[m][mode]["samples_per_s"] / summary[m][baseline]["samples_per_s"] for m in models]
        for mode in modes
    }
    fig, ax = plt.subplots(figsize=(max(7.0, 2.2 + 1.6 * len(models) * len(modes)), 4.5))
    grouped_bars(ax, models, series, "%.2f")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_ylabel(f"throughput / {baseline} throughput")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def training_intro(doc: Doc) -> str:
    """How a training benchmark ran, from the options it recorded."""
    args = doc["args"]
    engine = f", hvdplus engine {args['engine']}" if "engine" in args else ""
    return (
        f"{args['np']} ranks, batch {doc['batch_per_rank']} per rank{engine}; each mode in its own jobs, "
        f"{count(args['rounds'], 'alternating round')} of {args['reps']} blocks of {args['steps']} steps per "
        "model; medians over the blocks."
    )


def render_training(doc: Doc, figures: Figures) -> list[str]:
    """bench_training.json: every mode against the first one (DDP), in a table and a bar chart."""
    summary = doc["summary"]
    baseline = next(iter(next(iter(summary.values()))))  # bench_training.py's first mode
    lines = [training_intro(doc) + f" Throughput ratio = {baseline}'s step time / the mode's (above 1: faster).", ""]
    lines += training_table(summary, [(f"throughput vs {baseline}", f"ratio_to_{baseline}")])
    title = f"PyTorch training throughput against {baseline}, {doc['args']['np']} ranks"
    lines.append(
        figures.save(
            throughput_figure(figures.plt, summary, baseline, title),
            "training",
            "training throughput ratio per model and mode",
        )
    )
    return lines


def render_training_keras(doc: Doc, figures: Figures) -> list[str]:
    """bench_training_keras.json: step-time ratios as the benchmark prints them; throughput against MWMS plotted."""
    summary = doc["summary"]
    lines = [
        training_intro(doc) + " `single` is one process without collectives; the ratios are of step times "
        "(below 1: hvdplus steps faster).",
        "",
    ]
    lines += training_table(
        summary, [("step time vs mwms", "step_time_vs_mwms"), ("step time vs single", "step_time_vs_single")]
    )
    title = f"Keras training throughput against mwms, {doc['args']['np']} ranks"
    lines.append(
        figures.save(
            throughput_figure(figures.plt, summary, "mwms", title),
            "training_keras",
            "Keras training throughput ratio per model and mode",
        )
    )
    return lines


# ============================================================================ ZeRO
def zero_rows(ranks: str, rows: Doc) -> list[list[str]]:
    """DistributedOptimizer's row, then ZeroOptimizer's with its ratios and the issue's targets."""
    full, zero, checks = rows["distributed"], rows["zero"], rows["checks"]
    return [
        [
            ranks,
            OPTIMIZER_NAMES["distributed"],
            f"{full['state_bytes_max'] / MIB:.0f} MiB",
            f"{full['peak_rss_bytes_median'] / MIB:.0f} MiB",
            f"{ms(full['step_s_median'])} ms",
        ],
        [
            ranks,
            OPTIMIZER_NAMES["zero"],
            f"{zero['state_bytes_max'] / MIB:.0f} MiB ({checks['state_ratio']:.3f}x; target <= "
            f"{checks['state_target']:.3f}x)",
            f"{zero['peak_rss_bytes_median'] / MIB:.0f} MiB ({-checks['rss_drop_bytes'] / MIB:+.0f} MiB; target "
            f"-{checks['rss_drop_target_bytes'] / MIB:.0f} MiB)",
            f"{ms(zero['step_s_median'])} ms ({checks['step_ratio']:.2f}x; target <= {checks['step_target']:.2f}x)",
        ],
    ]


def zero_figure(plt: Any, by_ranks: dict[str, Doc]) -> Any:
    """Bars per rank count, DistributedOptimizer beside ZeroOptimizer: state per rank, peak RSS, step time."""
    metrics = (
        ("AdamW state per rank (MiB)", "state_bytes_max", 1 / MIB),
        ("peak RSS per process, median (MiB)", "peak_rss_bytes_median", 1 / MIB),
        ("step time (ms)", "step_s_median", 1e3),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 4.5))
    groups = [f"{ranks} ranks" for ranks in by_ranks]
    for ax, (label, key, scale) in zip(axes, metrics):
        grouped_bars(
            ax,
            groups,
            {name: [rows[mode][key] * scale for rows in by_ranks.values()] for mode, name in OPTIMIZER_NAMES.items()},
            "%.0f",
        )
        ax.set_title(label)
    axes[0].legend(fontsize="small")
    return fig


def render_overhead(doc: Doc, figures: Figures) -> list[str]:
    """What each distributed step adds beyond compute and one raw allreduce, against DDP's."""
    median, overhead, ratios = doc["median_s"], doc["overhead_s"], doc["ratio_to_ddp"]
    rows = [[mode, ms(median[mode]), "", ""] for mode in ("single", "raw_mpi", "raw_gloo")]
    rows += [[mode, ms(median[mode]), ms(overhead[mode]), ratio(ratios[mode])] for mode in overhead]
    return [
        f"{doc['tensors']} parameters of {doc['floats']} floats, {doc['args']['np']} ranks: a step's overhead is its "
        "time minus the same step in one process (`single`) minus one raw allreduce of all the gradients' bytes "
        "(`raw_mpi`, `raw_gloo`).",
        "",
        *table(["mode", "step (ms)", "overhead (ms)", "overhead vs DDP's"], rows),
        "",
    ]


def render_zero(doc: Doc, figures: Figures) -> list[str]:
    """bench_zero.json: the README's table per rank count (ranks are JSON string keys, sorted as numbers)."""
    by_ranks = dict(sorted(doc["ranks"].items(), key=lambda item: int(item[0])))
    lines = [
        f"A {doc['params'] / 1e6:.0f}M-parameter MLP of {doc['width']}-wide Linear layers, AdamW, batch "
        f"{doc['batch']}, MPI engine; each optimizer in its own jobs, {count(doc['rounds'], 'round')}; "
        "medians.",
        "",
    ]
    lines += table(
        ["ranks", "optimizer", "AdamW state per rank", "peak RSS per process", "step"],
        [row for ranks, rows in by_ranks.items() for row in zero_rows(ranks, rows)],
    )
    lines.append(figures.save(zero_figure(figures.plt, by_ranks), "zero", "ZeRO state, peak RSS and step time"))
    return lines


ZERO3_NAMES = {
    "zero3": "stage 3 (hvd.shard_parameters)",
    "fsdp2": "FSDP2 (fully_shard, Gloo)",
    "zero": "stage 1/2 (hvd.ZeroOptimizer)",
    "distributed": "DistributedOptimizer",
}


def zero3_table(doc: Doc) -> list[str]:
    """One row per configuration: peak RSS, resident model state, bytes sent, step time (ratios on stage 3's)."""
    summary, checks = doc["summary"], doc["checks"]
    rows = []
    for mode, name in ZERO3_NAMES.items():
        row = summary[mode]
        step = f"{row['step_s_median']:.2f} s"
        if mode == "zero3":
            step += (
                f" ({checks['step_ratio_vs_fsdp2']:.2f}x FSDP2's, target <= 0.6; "
                f"{checks['step_ratio_vs_zero']:.2f}x stage 2's, target <= 1.25)"
            )
        rows.append(
            [
                name,
                f"{row['peak_rss_bytes_max'] / MIB:.0f} MiB",
                f"{row['param_bytes'] / MIB:.0f} MiB",
                f"{row['grad_bytes'] / MIB:.0f} MiB",
                f"{row['state_bytes'] / MIB:.0f} MiB",
                f"{row['sent_bytes_per_step'] / MIB:.0f} MiB",
                step,
            ]
        )
    return table(["", "peak RSS per rank", "parameters", "gradients", "AdamW state", "sent per step", "step"], rows)


def zero3_figure(plt: Any, doc: Doc) -> Any:
    """Bars per configuration: peak RSS per rank, resident model state, step time."""
    summary = doc["summary"]
    metrics = (
        ("peak RSS per rank (MiB)", lambda r: r["peak_rss_bytes_max"] / MIB),
        (
            "resident model state per rank (MiB)",
            lambda r: (r["param_bytes"] + r["grad_bytes"] + r["state_bytes"]) / MIB,
        ),
        ("step time (s)", lambda r: r["step_s_median"]),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 4.5))
    names = [ZERO3_NAMES[mode].split(" (")[0] for mode in ZERO3_NAMES]
    for ax, (label, value) in zip(axes, metrics):
        bars = ax.bar(names, [value(summary[mode]) for mode in ZERO3_NAMES], color="tab:blue")
        ax.bar_label(bars, fmt="%.1f" if "time" in label else "%.0f", fontsize="small")
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    return fig


def render_zero3(doc: Doc, figures: Figures) -> list[str]:
    """bench_zero3.json: the four configurations, the targets, and the memory-limit run."""
    checks, ranks = doc["checks"], doc["ranks"]
    lines = [
        f"A GPT-style transformer of {doc['params'] / 1e6:.0f}M parameters ({doc['layers']} pre-norm "
        f"TransformerEncoderLayers, d 1024, 8192-token vocabulary), AdamW fp32, batch {doc['batch'][0]} x "
        f"{doc['batch'][1]} per rank, {ranks} ranks of one thread; each configuration in its own jobs, "
        f"{count(doc['rounds'], 'round')} in alternating order. Peak RSS over the timed steps only (VmHWM "
        "reset after setup); parameters, gradients and AdamW state resident right after a step; bytes a rank "
        "sends per step from the calls made (ring costs; Gloo's reduce-scatter runs an allreduce).",
        "",
    ]
    lines += zero3_table(doc)
    lines += [
        f"Stage 3's resident model state is {checks['state_ratio_vs_distributed']:.3f}x "
        f"DistributedOptimizer's (target: at most 1/{ranks} of it plus one unit: "
        f"{'met' if checks['state_ok'] else 'missed'}); its peak RSS is "
        f"{'below' if checks['rss_ok'] else 'not below'} FSDP2's.",
        "",
    ]
    demo = doc.get("memory_limit")
    if demo:
        single = (
            "killed by the OOM killer"
            if any(code in (-9, 137) for code in demo["single_exit_codes"])
            else f"exits {demo['single_exit_codes']}"
        )
        trained = "trains" if not any(demo["zero3_exit_codes"]) else f"exits {demo['zero3_exit_codes']}"
        peaks = ", ".join(f"{peak / MIB:.0f}" for peak in demo["zero3_peak_rss_bytes"] or [])
        lines += [
            f"Under a memory limit of {demo['limit_bytes'] / MIB:.0f} MiB per process (a cgroup each): one "
            f"process training the model with plain AdamW is {single}; stage 3 at {ranks} ranks {trained} "
            f"(peak RSS {peaks} MiB, step {demo['zero3_step_s'] or 0:.2f} s).",
            "",
        ]
    lines.append(
        figures.save(zero3_figure(figures.plt, doc), "zero3", "ZeRO-3 against FSDP2, stage 2 and DistributedOptimizer")
    )
    return lines


# ============================================================================ pipeline
def verdict(row: Doc) -> str:
    """One configuration's target verdict as bench_pipeline.py judged it, with the figure it judged."""
    target, m = row["target"], row["micro_batches"]
    if target["passed"] is None:
        return f"M={m} n/a ({target['text']})"
    judged = (
        f"{100 * target['max_abs_error']:.1f} pp"
        if "max_abs_error" in target
        else f"{target['bubble_ratio']:.2f}x, mem {target['memory_ratio']:.2f}x"
    )
    return f"M={m} {'PASS' if target['passed'] else 'FAIL'} {judged}"


def pipeline_table(rows: list[Doc]) -> list[str]:
    """A row per schedule and stage count: mean bubble / theory per M, stage 0's activations, the targets."""
    counts = sorted({row["micro_batches"] for row in rows})
    keys = list(dict.fromkeys(row["schedule"] for row in rows))
    out = []
    for stages in sorted({row["stages"] for row in rows}):
        for key in keys:
            mine = {row["micro_batches"]: row for row in rows if row["stages"] == stages and row["schedule"] == key}
            if not mine:
                continue
            cells = [f"{mine[m]['bubble_mean']:.3f} / {mine[m]['theory']:.3f}" if m in mine else "" for m in counts]
            verdicts = "; ".join(verdict(mine[m]) for m in sorted(mine) if mine[m]["target"]) or "-"
            act0 = f"{mine[counts[-1]]['peak_saved_bytes'][0] / 1024:.0f}" if counts[-1] in mine else ""
            out.append([SCHEDULE_NAMES.get(key, key), stages, *cells, act0, verdicts])
    return table(
        ["schedule", "S", *(f"M={m} measured / theory" for m in counts), f"act0 KiB (M={counts[-1]})", "target"], out
    )


def compare_lines(compare: Doc) -> list[str]:
    """The step time of the pipelined model against the same model data-parallel."""
    medians = compare["step_s_median"]
    return [
        f"Step time, {compare['layers']} x (Linear({compare['width']}, {compare['width']}) + Tanh), global "
        f"batch {compare['batch']}, {compare['ranks']} ranks, medians over {count(compare['rounds'], 'round')}:",
        "",
        *table(
            ["", "step (ms)"],
            [
                [f"1F1B pipeline (S={compare['ranks']}, M={compare['micro_batches']})", ms(medians["pipeline"])],
                ["data-parallel DistributedOptimizer", ms(medians["data-parallel"])],
                ["pipeline / data-parallel", f"{compare['ratio']:.2f}x"],
            ],
        ),
    ]


def render_pipeline(doc: Doc, figures: Figures) -> list[str]:
    """bench_pipeline.json: bubbles against theory with the targets, bench_pipeline.py's own plot, the step time."""
    rows, args = doc["rows"], doc["args"]
    lines = [
        f"Bubble = a stage's idle time / the step's wall time, median over the timed steps, mean over the "
        f"stages; theory for F = B = W; act0: stage 0's peak autograd-saved bytes. Real layers at S = "
        f"{args['real_stages']}, layers that sleep {args['sleep_ms']:g} ms at the other S; "
        f"{count(args['rounds'], 'round')}. Targets: GPipe and 1F1B within {100 * BUBBLE_TOLERANCE:.0f} pp of "
        f"theory on every stage (the largest error shown); ZB-H1 and ZB-V at most {ZB_BUBBLE_RATIO}x 1F1B's "
        f"bubble, with stage 0's activations (mem) at most {ZB_MEMORY_RATIO}x 1F1B's.",
        "",
    ]
    if rows:
        lines += pipeline_table(rows)
        plot_pipeline(rows, str(figures.path("pipeline")))
        figures.plt.close("all")
        lines.append(figures.link("pipeline", "pipeline bubble against micro-batches, measured and theory"))
    if doc.get("compare"):
        lines += compare_lines(doc["compare"])
    return lines


# ============================================================================ elastic
def summary_value(row: Doc) -> str:
    """A summary row's value with its unit, target and reference, as bench_elastic.py judged them."""
    value = f"{row['value']:.2f} {row['unit']}" if row["unit"] != "x" else f"{row['value']:.2f}x"
    extras = [f"target {'<=' if row['unit'] != 'GB/s' else '>='} {row['target']:g}"] if "target" in row else []
    if "reference" in row:
        extras.append(f"{row['reference_name']}: {row['reference']:.2f} {row['unit']}")
    return value + (f" ({'; '.join(extras)})" if extras else "")


def render_elastic(doc: Doc, figures: Figures) -> list[str]:
    """bench_elastic.json: its summary rows, then the scale-up's phases (where the time goes)."""
    lines = [
        "Recovery: 4 workers on 2 local hosts, one SIGKILLed, from the last step before the failure to the "
        "first at size 2. Scale-up: 2 workers, the discovery script then lists 2 more slots. Commit: a "
        "50M-parameter MLP with AdamW in a TorchState, against one torch copy of the same bytes into "
        "preallocated buffers. Sync: the same state broadcast from rank 0 after a reset.",
        "",
    ]
    lines += table(["metric", "value"], [[row["metric"], summary_value(row)] for row in doc["summary"]])
    phases = doc.get("scaleup", {}).get("median_phases_s") or {}
    if phases:
        lines += ["Scale-up, where the time goes (medians):", ""]
        labels = dict(SCALEUP_PHASES)
        lines += table(
            ["phase", "seconds"], [[labels.get(name, name), f"{seconds:.3f}"] for name, seconds in phases.items()]
        )
    return lines


def render_zero_gpu(doc: Doc, figures: Figures) -> list[str]:
    """The largest model per mode under the GPU cap, step times against each anchor, and memory at 2 ranks.
    Targets (issue 44): stage 3 with offload trains >= 10x DistributedOptimizer's largest model; <= 1.0x
    FSDP2's step in the same configuration; DistributedOptimizer <= 1.05x plain torch."""
    lines = [
        f"On {doc['device']}, GPU memory capped at {doc['cap_gib']:g} GiB, {doc['batch_tokens']} tokens a step, "
        f"activation checkpointing {'on' if doc['checkpoint'] else 'off'}.",
        "",
    ]
    largest = doc.get("largest")
    if largest:
        anchor = (largest.get("distributed") or {}).get("params")
        rows = [
            [mode, "out of memory at the smallest"]
            if best is None
            else [mode, f"{best['params'] / 1e6:.1f}M ({best['layers']} x {best['width']})"]
            + ([ratio(best["params"] / anchor)] if anchor else [""])
            for mode, best in largest.items()
        ]
        lines += table(["mode", "largest model trained", "against DistributedOptimizer"], rows) + [""]
    speed = doc.get("speed")
    if speed:
        rows = []
        for mode, row in speed.items():
            ratios = ", ".join(
                f"{ratio(v)} {k[len('ratio_to_') :]}" for k, v in row.items() if k.startswith("ratio_to_")
            )
            cells = ["out of memory", "", ""] if row.get("oom") else [ms(row["step_s"]), f"{row['tokens_per_s']:,.0f}"]
            rows.append([mode, *cells[:2], ratios])
        lines += table(["mode", "step (ms)", "tokens/s", "against"], rows) + [""]
    if doc.get("ranks"):
        rows = [
            [mode, ", ".join("-" if peak is None else f"{peak / MIB:,.0f} MiB" for peak in peaks)]
            for mode, peaks in doc["ranks"].items()
        ]
        lines += table(["mode, 2 ranks on one GPU", "peak GPU memory per rank"], rows) + [""]
    return lines


# ============================================================================ the report
@dataclass(frozen=True)
class Benchmark:
    """A section of the report: the JSON file it reads, the command that writes that file, how to render it."""

    title: str
    filename: str
    command: str
    render: Callable[[Doc, Figures], list[str]]


BENCHMARKS = (
    Benchmark(
        "Allreduce against the raw engine call",
        "bench_collectives.json",
        "python scripts/bench_collectives.py --engine both --np 2,3 --json results/bench_collectives.json",
        render_collectives,
    ),
    Benchmark(
        "Multi-host allreduce against the cost model",
        "bench_multihost.json",
        "sudo .venv/bin/python scripts/bench_multihost.py --shapes 2x2,2x4 --rate 1gbit "
        "--json results/bench_multihost.json",
        render_multihost,
    ),
    Benchmark(
        "Training throughput, PyTorch",
        "bench_training.json",
        "python scripts/bench_training.py --json results/bench_training.json",
        render_training,
    ),
    Benchmark(
        "Framework overhead per step",
        "bench_overhead.json",
        "python scripts/bench_overhead.py --json results/bench_overhead.json",
        render_overhead,
    ),
    Benchmark(
        "Training throughput, Keras",
        "bench_training_keras.json",
        "python scripts/bench_training_keras.py --json results/bench_training_keras.json",
        render_training_keras,
    ),
    Benchmark(
        "ZeRO optimizer-state sharding",
        "bench_zero.json",
        "python scripts/bench_zero.py --np 2,3 --json results/bench_zero.json",
        render_zero,
    ),
    Benchmark(
        "ZeRO-3 parameter sharding against FSDP2", "bench_zero3.json", "python scripts/bench_zero3.py", render_zero3
    ),
    Benchmark(
        "Pipeline schedules",
        "bench_pipeline.json",
        "python scripts/bench_pipeline.py --json results/bench_pipeline.json --plot results/bench_pipeline.png",
        render_pipeline,
    ),
    Benchmark("Elastic training", "bench_elastic.json", "python scripts/bench_elastic.py", render_elastic),
    Benchmark(
        "ZeRO and offload on one GPU against FSDP2",
        "bench_zero_gpu.json",
        "python scripts/bench_zero_gpu.py --cap-gib 16",
        render_zero_gpu,
    ),
)


def measured(doc: Doc, path: Path) -> str:
    """When the numbers were taken: the JSON's own date, else the file's modification time."""
    date = doc.get("date") or doc.get("timestamp")
    if date:
        return str(date)
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime).isoformat(timespec="seconds")
    return f"{mtime} (file time)"


def machine(doc: Doc) -> str:
    """Where the numbers were taken, from what the JSON records (host, CPUs, the simulated hosts' link), or ""."""
    infos = [report.get("info", {}) for report in doc.get("configurations", {}).values()]
    cpus = doc.get("cpus") or next((info["cpus"] for info in infos if "cpus" in info), None)
    parts = [
        f"host {doc['host']}" if "host" in doc else "",
        f"{cpus} CPUs" if cpus else "",
        f"simulated hosts, {doc['rate']} link" if "rate" in doc else "",
    ]
    return ", ".join(part for part in parts if part)


def section(bench: Benchmark, doc: Doc | None, path: Path, figures: Figures) -> list[str]:
    """A benchmark's section: when and where, its tables and plots, and how to reproduce them."""
    head = [f"## {bench.title}", ""]
    if doc is None:
        return head + [f"Not measured yet: `{bench.command}` writes `{bench.filename}`.", ""]
    try:
        body = bench.render(doc, figures)
    except KeyError as exc:
        raise SystemExit(
            f"{path}: no key {exc} where scripts/bench_report.py expects it; rewrite the file with `{bench.command}`"
        ) from None
    where = f" on {machine(doc)}" if machine(doc) else "; the JSON records no machine"
    return head + [f"Measured {measured(doc, path)}{where}.", "", *body, f"Reproduce: `{bench.command}`", ""]


def overview(found: dict[Benchmark, tuple[Doc | None, Path]]) -> list[str]:
    """The table at the top: every benchmark, when and where it was measured, or that it was not."""
    rows = [
        [
            bench.title,
            f"`{bench.filename}`",
            measured(doc, path) if doc else "not measured yet",
            (machine(doc) or "not recorded") if doc else "",
        ]
        for bench, (doc, path) in found.items()
    ]
    return table(["benchmark", "file", "measured", "machine"], rows)


def report(results: Path, figures: Figures) -> str:
    """The whole markdown document; writes the plots on the way."""
    found = {}
    for bench in BENCHMARKS:
        path = results / bench.filename
        found[bench] = (json.loads(path.read_text()) if path.exists() else None, path)
    lines = [
        "# hvdplus performance",
        "",
        f"Generated by `python scripts/bench_report.py` from the benchmarks' JSON files in `{results}`, so the "
        "tables and plots match those files; rerun a benchmark, then the report, to refresh them. No baseline is "
        "timed beside a running hvdplus: each is timed before `hvd.init()` or after `hvd.shutdown()`.",
        "",
        *overview(found),
    ]
    for bench, (doc, path) in found.items():
        lines += section(bench, doc, path, figures)
    return "\n".join(lines).rstrip("\n") + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """--results and --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, default=Path("results"), help="folder of the benchmarks' JSON files (default results/)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/performance.md"),
        help="the markdown file to write; the plots go to img/ beside it (default docs/performance.md)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Read the results, write the plots and the markdown file."""
    args = parse_args(argv)
    img_dir = args.out.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    figures = Figures(load_pyplot(), img_dir, os.path.relpath(img_dir, args.out.parent))
    args.out.write_text(report(args.results, figures))
    print(f"wrote {args.out} and its plots in {img_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
