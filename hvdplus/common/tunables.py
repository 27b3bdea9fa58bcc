"""The settings that may change while a job runs: the autotuner moves them, every rank in the same cycle.

The coordinator and the executor read them from one shared `Tunables` each cycle instead of from the frozen
`Settings`, so a change applies at a cycle boundary and never in the middle of a batch."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hvdplus.common.settings import Settings

__all__ = ["Tunables"]


@dataclass
class Tunables:
    """Live values of the tunable settings (see `Settings` for their meaning)."""

    fusion_threshold: int
    cycle_time_ms: float
    hierarchical_allreduce: bool
    hierarchical_allgather: bool
    cross_algorithm: str
    hierarchical_chunk_bytes: int  # not tuned

    @classmethod
    def from_settings(cls, settings: Settings) -> Tunables:
        """The starting values: the user's settings."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
