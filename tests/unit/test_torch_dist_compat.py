"""torch.distributed's names across the releases hvdplus runs on: torch 2.13 adds all_gather_single and deprecates
all_gather_into_tensor; torch 2.11 (the GPU machines' build) has only the older name, which is how the first GPU
run found that every init failed there. (Reduce-scatter runs on the process group itself: engines/nccl.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from hvdplus.common.engines.torch_collectives import all_gather_single


def older(*args, **kwargs):
    return "older"


def newer(*args, **kwargs):
    return "newer"


def test_the_new_names_where_torch_has_them():
    dist = SimpleNamespace(all_gather_single=newer, all_gather_into_tensor=older)
    assert all_gather_single(dist)() == "newer"


def test_the_older_names_on_torch_before_2_13():
    dist = SimpleNamespace(all_gather_into_tensor=older)
    assert all_gather_single(dist)() == "older"
