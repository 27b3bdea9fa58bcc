"""TorchState's commits: one preallocated host copy of the state, reused by every commit, never aliased by what a
restore hands back to the optimizer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvdplus.torch.elastic.snapshot import Snapshot  # noqa: E402


def _adam_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_commits_copy_into_the_same_buffers_and_restore_the_committed_values():
    model, optimizer = _adam_state()
    snapshot = Snapshot(optimizer.state_dict())
    buffers = [t.data_ptr() for s in snapshot.tree["state"].values() for t in s.values() if t.dim()]
    committed = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    snapshot.save(optimizer.state_dict())
    assert [t.data_ptr() for s in snapshot.tree["state"].values() for t in s.values() if t.dim()] == buffers
    stepped = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    assert not torch.equal(stepped["exp_avg"], committed["exp_avg"])
    optimizer.load_state_dict(snapshot.fresh())
    live = optimizer.state_dict()["state"][0]
    assert all(torch.equal(live[k], stepped[k]) for k in stepped)
    assert live["exp_avg"].data_ptr() not in buffers  # the optimizer does not hold the commit's buffers
    optimizer.step()
    assert torch.equal(snapshot.tree["state"][0]["exp_avg"], stepped["exp_avg"])  # stepping did not touch it


def test_the_snapshot_holds_one_copy_of_the_tensors_and_reallocates_only_what_changed():
    model, _ = _adam_state()
    snapshot = Snapshot(model.state_dict())
    held = sum(t.numel() * t.element_size() for t in snapshot.tree.values())
    assert held == sum(p.numel() * p.element_size() for p in model.state_dict().values())
    weight = snapshot.tree["weight"].data_ptr()
    model.bias = torch.nn.Parameter(torch.zeros(6))  # a different shape: only its buffer is new
    snapshot.save(model.state_dict())
    assert snapshot.tree["weight"].data_ptr() == weight and snapshot.tree["bias"].shape == (6,)
    model.weight.data.fill_(3.0)
    model.load_state_dict(snapshot.tree)
    assert torch.equal(model.weight, snapshot.tree["weight"]) and model.weight.data_ptr() != weight
