"""ElasticSampler: a DistributedSampler that resumes mid-epoch after an elastic reset (Horovod's, same API).

The epoch's indices (shuffled with `seed + epoch`) are dealt round-robin over the ranks, so after k recorded
batches of b samples the job has processed exactly the first k*b*size of them, whatever the size was. A reset
deals the unprocessed rest over the new size: no sample is skipped or repeated, except the padding that makes
the last batch even over the ranks (at most size-1 samples per epoch, as DistributedSampler pads).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from hvdplus.common.basics import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions `dataset` over the ranks and re-partitions what is left of the epoch after a reset.

    Keep it in the TorchState, call `record_batch()` after each batch (before the commit) and `set_epoch()` at
    the end of each epoch (not the start: a reset mid-epoch must keep the epoch's progress)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a new shuffle, nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of `batch_size` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """Count the samples of one batch, by their indices (their number on every rank)."""
        self.record_batch(0, len(indices))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Deal the epoch's unprocessed indices over the job's current ranks."""
        self.num_replicas, self.rank = size(), rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices + self.remaining_indices[: self.total_size - len(self.remaining_indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
