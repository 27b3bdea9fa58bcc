"""The autotune search (common/autotune.py), driven with synthetic throughput: pure logic, one process."""

import csv
import itertools
import math
from dataclasses import fields

import pytest

from hvdplus.common.autotune import CYCLE_TIMES_MS, FUSION_THRESHOLDS, TUNED, Autotuner, tuning_space
from hvdplus.common.settings import Settings
from hvdplus.common.tunables import Tunables

MiB = 1024 * 1024


def peaked(values: dict) -> float:
    """Throughput (bytes/s) that peaks at a 16 MiB fusion threshold and a 2.5 ms cycle, hierarchical on, ring."""
    fusion = -abs(math.log2((values["fusion_threshold"] + MiB) / (17 * MiB)))
    cycle = -abs(math.log2(values["cycle_time_ms"] / 2.5))
    bonus = (values["hierarchical_allreduce"] is True) + (values["cross_algorithm"] == "ring")
    return 1000.0 * (20 + fusion + cycle + bonus)


def drive(tuner: Autotuner, space, score, max_cycles: int = 10_000) -> list[int]:
    """Run cycles of one second each, every one carrying score(configuration) bytes, as the coordinator does:
    the configuration sent at a cycle's start applies after it; return the configuration of each sample."""
    applied, now, sampled = tuner.config, 0.0, []
    for _ in range(max_cycles):
        if tuner.done:
            break
        sent, samples = tuner.config, tuner.samples
        now += 1.0
        tuner.record(applied, int(score(space.decode(applied))), now)
        if tuner.samples != samples:
            sampled.append(applied)
        applied = sent
    return sampled


def make(fixed=(), hierarchical=False, hosts=2, warmup=0, steps=3, max_samples=20, log_path="", **start):
    space = tuning_space(Tunables.from_settings(Settings(**start)), frozenset(fixed), hierarchical, hosts)
    return space, Autotuner(
        space, warmup_samples=warmup, steps_per_sample=steps, max_samples=max_samples, log_path=log_path
    )


def rows(path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_tuned_names_are_tunables():
    assert set(TUNED) <= {f.name for f in fields(Tunables)}


def test_encoding_round_trips_every_configuration():
    space, _ = make(hierarchical=True, hosts=4)
    assert space.size == 6 * 5 * 2 * 3 * 2
    for index in range(space.size):
        assert space.encode(space.decode(index)) == index
    configurations = [tuple(space.decode(i).values()) for i in range(space.size)]
    assert set(configurations) == set(itertools.product(*space.candidates.values()))
    with pytest.raises(ValueError, match="outside the tuning space"):
        space.decode(space.size)


def test_start_is_the_users_settings_with_auto_resolved():
    space, _ = make(hierarchical=True, hosts=3)
    assert space.decode(space.start) == {
        "fusion_threshold": 128 * MiB,
        "cycle_time_ms": 1.0,
        "hierarchical_allreduce": False,
        "cross_algorithm": "ring",
        "hierarchical_allgather": False,
    }
    assert space.candidates["cross_algorithm"] == ("ring", "engine")  # 3 hosts: no halving-doubling
    assert make(hierarchical=True, hosts=4)[0].candidates["cross_algorithm"][0] == "halving-doubling"


def test_hierarchical_options_only_where_the_job_can_use_them():
    space, _ = make(hierarchical=False)
    assert space.free == ("fusion_threshold", "cycle_time_ms")
    assert space.decode(space.start)["hierarchical_allreduce"] is False  # left as the user had it
    space, _ = make(fixed={"hierarchical_allreduce"}, hierarchical=True, hierarchical_allreduce=False)
    assert space.free == ("fusion_threshold", "cycle_time_ms", "hierarchical_allgather")


def test_converges_to_the_best_configuration():
    space, tuner = make(hierarchical=True, hosts=2, max_samples=40)
    sampled = drive(tuner, space, peaked)
    assert tuner.done and space.decode(tuner.config) == {
        "fusion_threshold": 16 * MiB,
        "cycle_time_ms": 2.5,
        "hierarchical_allreduce": True,
        "cross_algorithm": "ring",
        "hierarchical_allgather": False,
    }
    assert len(sampled) == len(set(sampled))  # no configuration measured twice


def test_cross_algorithm_is_not_searched_while_hierarchical_allreduce_is_off():
    def flat_wins(values):
        return 2000.0 if values["hierarchical_allreduce"] is False else 1000.0

    space, tuner = make(hierarchical=True, hosts=2, max_samples=40)
    sampled = drive(tuner, space, flat_wins)
    assert space.decode(tuner.config)["hierarchical_allreduce"] is False
    algorithms = {space.decode(c)["cross_algorithm"] for c in sampled}
    assert algorithms == {"halving-doubling"}


def test_fixed_settings_stay_fixed():
    space, tuner = make(fixed={"cycle_time_ms", "hierarchical_allgather"}, hierarchical=True, cycle_time_ms=3.0)
    sampled = drive(tuner, space, peaked)
    assert {space.decode(c)["cycle_time_ms"] for c in sampled} == {3.0}
    assert {space.decode(c)["hierarchical_allgather"] for c in sampled} == {False}
    assert len({space.decode(c)["fusion_threshold"] for c in sampled}) == len(FUSION_THRESHOLDS)
    assert space.decode(tuner.config)["fusion_threshold"] == 16 * MiB


def test_warmup_is_discarded_and_max_samples_respected(tmp_path):
    path = tmp_path / "at.csv"
    space, tuner = make(warmup=2, max_samples=4, log_path=str(path))
    cycles = itertools.count(1)
    by_fusion = {128 * MiB: 10.0, 0: 20.0, 1 * MiB: 30.0, 4 * MiB: 25.0}

    def score(values):  # the warmup samples (cycles 2 and 3; the first starts the clock) would win if they counted
        return 1e9 if next(cycles) <= 3 else by_fusion[values["fusion_threshold"]]

    sampled = drive(tuner, space, score)
    assert len(sampled) == 6 and sampled[:3] == [space.start] * 3
    table = rows(path)
    assert [r["phase"] for r in table] == ["warmup", "warmup", "sample", "sample", "sample", "sample", "chosen"]
    chosen = table[-1]
    assert chosen["sample"] == "5" and float(chosen["score"]) == 30.0
    assert int(chosen["fusion_threshold"]) == space.decode(tuner.config)["fusion_threshold"] == 1 * MiB


def test_settles_when_a_pass_improves_nothing():
    space, tuner = make(max_samples=100)
    sampled = drive(tuner, space, lambda values: 1000.0)
    assert tuner.done and tuner.config == space.start
    assert len(sampled) == 1 + (len(FUSION_THRESHOLDS) - 1) + (len(CYCLE_TIMES_MS) - 1)


def test_log_has_a_row_per_sample_with_bytes_seconds_and_score(tmp_path):
    path = tmp_path / "at.csv"
    space, tuner = make(fixed={"cycle_time_ms"}, steps=4, max_samples=3, log_path=str(path))
    drive(tuner, space, lambda values: 500.0)
    with open(path, newline="") as file:
        header = next(csv.reader(file))
    assert header == ["sample", "phase", *TUNED, "bytes", "seconds", "score"]
    table = rows(path)
    assert [r["sample"] for r in table] == ["1", "2", "3", "1"]
    for row in table:
        assert (int(row["bytes"]), float(row["seconds"]), float(row["score"])) == (2000, 4.0, 500.0)
        assert float(row["cycle_time_ms"]) == 1.0


def test_cycles_without_collectives_and_the_switching_cycle_are_not_counted():
    space, tuner = make(steps=2, max_samples=2)
    tuner.record(tuner.config, 100, 1.0)  # the first cycle only starts the clock
    tuner.record(tuner.config, 0, 2.0)
    tuner.record(tuner.config, 100, 3.0)
    first = tuner.config
    tuner.record(first, 100, 4.0)  # the second cycle with work ends the sample
    assert tuner.config != first
    tuner.record(first, 100, 5.0)  # the new configuration is not running yet
    tuner.record(tuner.config, 300, 6.0)
    tuner.record(tuner.config, 300, 8.0)
    assert tuner.done and tuner.config != first  # 600 bytes in 3 s beat 200 in 3 s
