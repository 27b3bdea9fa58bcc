"""Autotune (HOROVOD_AUTOTUNE): pick the tunable settings from throughput measured during a job's first steps.

Horovod searches with Bayesian optimisation over a Gaussian process. hvdplus runs coordinate descent over a
fixed grid instead: a job grants few samples (20 by default), which a handful of candidates per setting covers
without a model to fit; the search is deterministic, so its log explains every step and a run can be repeated;
and only rank 0 searches, sending each configuration to every rank as one small integer (its index in the
grid) inside the control round, so the ranks never need to agree on anything but that number.

A sample measures one configuration over `steps_per_sample` cycles that carried collectives; its score is the
bytes those collectives moved divided by the wall seconds the sample took (Horovod's score). The first
`warmup_samples` samples run the starting configuration and are discarded. After at most `max_samples`
measured samples, or once a whole pass over the settings improves nothing, the best configuration stays.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NamedTuple

from hvdplus.common.control.messages import Response
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings
from hvdplus.common.tunables import Tunables

__all__ = ["TUNED", "FUSION_THRESHOLDS", "CYCLE_TIMES_MS", "TuningSpace", "tuning_space", "Autotuner", "TuningRun"]

log = logging.getLogger("hvdplus")

# The tunables in the order coordinate descent visits them (the ones with the largest effect first); the same
# order encodes a configuration.
TUNED = ("fusion_threshold", "cycle_time_ms", "hierarchical_allreduce", "cross_algorithm", "hierarchical_allgather")
# The collectives whose bytes a sample counts (control operations such as joins move none).
_DATA_KINDS = frozenset({OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.ALLTOALL, OpKind.REDUCESCATTER})
FUSION_THRESHOLDS = tuple(mib * 1024 * 1024 for mib in (0, 1, 4, 16, 64, 128))
CYCLE_TIMES_MS = (0.5, 1.0, 2.5, 5.0, 10.0)


class TuningSpace:
    """The candidate values of every tunable; a configuration (one candidate each) is encoded as a small index."""

    def __init__(self, candidates: dict[str, tuple[Any, ...]], start: dict[str, Any]) -> None:
        self.candidates = {name: candidates[name] for name in TUNED}
        self.free = tuple(name for name in TUNED if len(self.candidates[name]) > 1)
        self.size = 1
        for name in TUNED:
            self.size *= len(self.candidates[name])
        # A starting value outside the grid ('auto') starts at the first candidate, which is what 'auto' does.
        self.start = self.encode(
            {name: start[name] if start[name] in values else values[0] for name, values in self.candidates.items()}
        )

    def encode(self, values: dict[str, Any]) -> int:
        """The index of a configuration: its candidates' positions as digits of a mixed-radix number."""
        index = 0
        for name in TUNED:
            index = index * len(self.candidates[name]) + self.candidates[name].index(values[name])
        return index

    def decode(self, index: int) -> dict[str, Any]:
        """The configuration of an index (`encode`'s inverse)."""
        if not 0 <= index < self.size:
            raise ValueError(f"configuration index {index} is outside the tuning space of {self.size}")
        values = {}
        for name in reversed(TUNED):
            index, position = divmod(index, len(self.candidates[name]))
            values[name] = self.candidates[name][position]
        return {name: values[name] for name in TUNED}

    def apply(self, index: int, tunables: Tunables) -> None:
        """Set the live tunables to a configuration."""
        for name, value in self.decode(index).items():
            setattr(tunables, name, value)

    def matters(self, name: str, index: int) -> bool:
        """Whether a tunable has an effect in a configuration: the cross-host algorithm needs hierarchical allreduce."""
        return name != "cross_algorithm" or self.decode(index)["hierarchical_allreduce"]

    def neighbours(self, index: int, name: str) -> list[int]:
        """The configurations equal to `index` except for `name`, which takes each of its candidates."""
        values = self.decode(index)
        return [self.encode({**values, name: candidate}) for candidate in self.candidates[name]]


def tuning_space(start: Tunables, fixed: Collection[str], hierarchical: bool, hosts: int) -> TuningSpace:
    """The grid autotune searches: settings in `fixed` (given by the user) keep their value, and the hierarchical
    options are candidates only when the job's ranks form `hierarchical` groups over `hosts` hosts."""
    can_be_on = hierarchical and not ("hierarchical_allreduce" in fixed and start.hierarchical_allreduce is False)
    # the first candidate of each is what its 'auto' setting does
    algorithms = ("halving-doubling", "ring", "engine") if hosts & (hosts - 1) == 0 else ("ring", "engine")
    grid: dict[str, tuple[Any, ...]] = {
        "fusion_threshold": FUSION_THRESHOLDS,
        "cycle_time_ms": CYCLE_TIMES_MS,
        "hierarchical_allreduce": (False, True) if hierarchical else (),
        "cross_algorithm": algorithms if can_be_on else (),
        "hierarchical_allgather": (False, True) if hierarchical else (),
    }
    current = {name: getattr(start, name) for name in TUNED}
    return TuningSpace(
        {name: grid[name] if grid[name] and name not in fixed else (current[name],) for name in TUNED}, current
    )


class _Sample(NamedTuple):
    number: int
    nbytes: int
    seconds: float
    score: float


class Autotuner:
    """Rank 0's search. Call `record` after every cycle; `config` is the configuration every rank should run."""

    def __init__(
        self, space: TuningSpace, *, warmup_samples: int, steps_per_sample: int, max_samples: int, log_path: str = ""
    ) -> None:
        self._space = space
        self._warmup_left, self._steps, self._max = warmup_samples, steps_per_sample, max_samples
        self._log_path = log_path
        self._measured: dict[int, _Sample] = {}  # the measured sample of each configuration tried
        self.samples = 0  # samples taken so far, warmup included
        self._bytes, self._cycles = 0, 0  # the sample in progress: bytes and cycles with collectives so far,
        self._started: float | None = None  # and when it began
        self._plan = self._search(space.start)
        self.config = next(self._plan)
        self.done = False
        if log_path:
            self._write(["sample", "phase", *TUNED, "bytes", "seconds", "score"], mode="w")

    def record(self, config: int, nbytes: int, now: float) -> None:
        """One cycle that ran under `config` ended at `now` (monotonic seconds), having completed collectives of
        `nbytes` bytes (0 if it carried none)."""
        if self.done:
            return
        if config != self.config or self._started is None:  # the sample starts once its configuration runs
            self._bytes, self._cycles, self._started = 0, 0, now
            return
        if nbytes:
            self._bytes += nbytes
            self._cycles += 1
            if self._cycles == self._steps:
                self._finish(now - self._started)
                self._bytes, self._cycles, self._started = 0, 0, now

    def _finish(self, seconds: float) -> None:
        self.samples += 1
        sample = _Sample(self.samples, self._bytes, seconds, self._bytes / max(seconds, 1e-9))
        warmup = self._warmup_left > 0
        self._log_sample("warmup" if warmup else "sample", self.config, sample)
        if warmup:
            self._warmup_left -= 1
            return
        self._measured[self.config] = sample
        following = next(self._plan, None) if len(self._measured) < self._max else None
        if following is None:
            self._settle()
        else:
            self.config = following

    def _search(self, start: int) -> Iterator[int]:
        """Coordinate descent: yield each untried configuration that changes one tunable of the best so far,
        tunable by tunable, moving to the best after each; stop after a pass that does not move."""
        best, moved = start, True
        yield start
        while moved:
            moved = False
            for name in self._space.free:
                if not self._space.matters(name, best):
                    continue
                options = self._space.neighbours(best, name)
                for option in options:
                    if option not in self._measured:
                        yield option
                top = max([best, *options], key=lambda config: self._measured[config].score)
                best, moved = top, moved or top != best

    def _settle(self) -> None:
        self.config = max(self._measured, key=lambda config: self._measured[config].score)
        self.done = True
        self._log_sample("chosen", self.config, self._measured[self.config])
        log.info("autotune chose %s after %d samples", self._space.decode(self.config), self.samples)

    def _log_sample(self, phase: str, config: int, sample: _Sample) -> None:
        if self._log_path:
            values = self._space.decode(config)
            self._write(
                [
                    sample.number,
                    phase,
                    *(values[name] for name in TUNED),
                    sample.nbytes,
                    f"{sample.seconds:.6f}",
                    f"{sample.score:.1f}",
                ]
            )

    def _write(self, row: list[Any], mode: str = "a") -> None:
        """One CSV row, the file closed after each, so the log is complete whenever the job stops."""
        with open(self._log_path, mode, newline="") as file:
            csv.writer(file).writerow(row)


class TuningRun:
    """A job's autotune, as the coordinator runs it: every rank starts from the same configuration of the same grid
    (settings and topology are equal everywhere), rank 0 alone searches, and every rank switches to the
    configuration rank 0 sent in a control round, all in the same cycle."""

    def __init__(self, tunables: Tunables, settings: Settings, rank: int, hierarchical: bool, hosts: int) -> None:
        self._tunables, self._rank = tunables, rank
        self._space = tuning_space(tunables, settings.explicit, hierarchical, hosts)
        self._tuned = self._space.start
        self._space.apply(self._tuned, tunables)
        self._tuner = (
            Autotuner(
                self._space,
                warmup_samples=settings.autotune_warmup_samples,
                steps_per_sample=settings.autotune_steps_per_sample,
                max_samples=settings.autotune_bayes_opt_max_samples,
                log_path=settings.autotune_log,
            )
            if rank == 0
            else None
        )

    @property
    def done(self) -> bool:
        """On rank 0: whether the search has settled on its best configuration."""
        return self._tuner is not None and self._tuner.done

    def word(self) -> int:
        """This rank's word in the control round: rank 0's configuration; the others' -1 leaves it in the AND."""
        return self._tuner.config if self._tuner else -1

    def after_cycle(self, config: int, responses: Sequence[Response]) -> None:
        """After a cycle's execution: rank 0's tuner records the bytes this rank moved, then every rank switches to
        `config`, the configuration rank 0 sent in this cycle's round."""
        if self._tuner is not None:
            moved = sum(
                r.nbytes for r in responses if r.kind in _DATA_KINDS and r.error is None and self._rank in r.members
            )
            self._tuner.record(self._tuned, moved, time.monotonic())
        if config != self._tuned:
            self._space.apply(config, self._tunables)
            self._tuned = config
