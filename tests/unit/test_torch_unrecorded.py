"""hvdplus.torch's collectives skip autograd's dispatch when autograd would not record the call
(op_base.differentiable): the same outputs as Function.apply, a graph only where one is needed."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hvdplus.torch.op_base import differentiable  # noqa: E402


class Doubled(torch.autograd.Function):
    """Returns twice its input and, unchanged, its second input (the case apply returns as a view)."""

    forwards = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, passed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Doubled.forwards += 1
        ctx.mark_non_differentiable(passed)
        return x * 2, passed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * 2, None


def test_a_call_autograd_records_goes_through_apply():
    x, passed = torch.ones(3, requires_grad=True), torch.zeros(2)
    doubled, same = differentiable(Doubled, x, passed)
    assert doubled.grad_fn is not None
    doubled.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    assert same.data_ptr() == passed.data_ptr()


@pytest.mark.parametrize("why", ["no input requires grad", "grad mode is off"])
def test_a_call_autograd_does_not_record_runs_forward_alone(why, monkeypatch):
    x, passed = torch.ones(3, requires_grad=why == "grad mode is off"), torch.zeros(2)
    with torch.set_grad_enabled(why != "grad mode is off"):
        expected, expected_same = Doubled.apply(x, passed)
        applies = []
        monkeypatch.setattr(Doubled, "apply", lambda *args: applies.append(args))
        forwards_before = Doubled.forwards
        doubled, same = differentiable(Doubled, x, passed)
    assert not applies and Doubled.forwards == forwards_before + 1  # the forward ran, autograd's dispatch did not
    assert doubled.grad_fn is None and not doubled.requires_grad
    assert torch.equal(doubled, expected)
    # An input returned unchanged comes back as apply returns it: a new tensor object over the same memory.
    assert same is not passed and expected_same is not passed
    assert same.data_ptr() == passed.data_ptr() == expected_same.data_ptr()
