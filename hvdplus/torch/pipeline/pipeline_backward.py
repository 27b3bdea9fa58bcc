"""A stage's backward, whole or split in two (Zero Bubble, Qi et al. 2024): B computes only the gradient of the
stage's input, which the previous stage waits for; W computes the weight gradients later from what B kept.

The split reuses the graph analysis of `torch.distributed.pipelining._backward` (which autograd nodes link the
weights to the input's path), and runs W with `torch.autograd.backward` where torch's own W uses
`autograd.grad`: the gradient then lands in `p.grad` through autograd's accumulator, so the post-accumulate
hooks of DistributedOptimizer and ZeroOptimizer fire. They must fire once per step, so only a parameter's last
backward of the step (`final=True`) goes through the accumulator; earlier micro-batches add into `p.grad`
by hand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups

from hvdplus.torch.zero.zero3_units import add_gradient

__all__ = ["backward_full", "backward_input", "backward_weight", "WeightWork"]


class WeightWork:
    """What B keeps for W: per group of weights, the intermediate autograd nodes and their gradients."""

    def __init__(self, groups: list[dict[str, Any]], params: list[torch.Tensor]) -> None:
        self.groups, self.params = groups, params


def _node(t: torch.Tensor) -> Node:
    """The autograd node of a tensor that requires grad: its grad_fn, or its accumulator for a leaf."""
    node = _get_grad_fn_or_grad_acc(t)
    assert node is not None  # None only for a tensor that requires no grad
    return node


def _add_into_grad(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            add_gradient(p, g)


def _run(
    roots: Sequence[Any],
    grads: Sequence[Any],
    targets: Sequence[Any],
    params: Sequence[torch.Tensor],
    final: bool,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Backpropagate from `roots` to `targets` (tensors or gradient edges); the last len(params) targets are
    those parameters' accumulators. Returns the gradients of the other targets."""
    others = len(targets) - len(params)
    if final:  # through the accumulators: p.grad += g, then the post-accumulate hooks; inputs are leaves
        torch.autograd.backward(roots, grads, inputs=list(targets), retain_graph=retain_graph)
        return tuple(t.grad for t in targets[:others])
    results = torch.autograd.grad(roots, list(targets), grads, retain_graph=retain_graph, allow_unused=True)
    _add_into_grad(params, results[others:])
    return tuple(results[:others])


def backward_full(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    final: bool,
) -> list[torch.Tensor | None]:
    """Gradients of `inputs` (None where one needs none) and, into p.grad, of `params`."""
    roots, grads = _roots(outputs, output_grads)
    wanted = [x for x in inputs if x.requires_grad]
    if not roots:
        return [None] * len(inputs)
    used = _reachable(construct_reverse_graph([r.grad_fn for r in roots]), params)
    targets: list[torch.Tensor | GradientEdge] = [*wanted, *(GradientEdge(_node(p), 0) for p in used)]
    found = iter(_run(roots, grads, targets, used, final))
    return [next(found) if x.requires_grad else None for x in inputs]


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    final: bool,
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of `inputs`; the weights' gradients are left for `backward_weight`, except for weights
    whose path does not meet the inputs' (their gradient is taken now, as W could no longer reach them)."""
    roots, grads = _roots(outputs, output_grads)
    wanted = [x for x in inputs if x.requires_grad]
    if not roots:
        return [None] * len(inputs), WeightWork([], [])
    reverse = construct_reverse_graph([r.grad_fn for r in roots])
    used = _reachable(reverse, params)
    accumulators = {_node(p): p for p in used}
    groups = get_param_groups([_node(x) for x in wanted], list(accumulators), reverse)
    covered = {acc for group in groups for acc in group["params"]}
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):

            def keep(grad_inputs: tuple, group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_inputs

            handles.append(node.register_prehook(keep))
    left = [p for acc, p in accumulators.items() if acc not in covered]
    try:
        targets: list[torch.Tensor | GradientEdge] = [*wanted, *(GradientEdge(_node(p), 0) for p in left)]
        found = iter(
            _run(
                roots,
                grads,
                targets,
                left,
                final,
                retain_graph=True,
            )
        )
        input_grads = [next(found) if x.requires_grad else None for x in inputs]
    finally:
        for handle in handles:
            handle.remove()
    for output in outputs:
        output.detach_()  # the graph above the intermediates is no longer needed
    return input_grads, WeightWork(groups, [accumulators[acc] for group in groups for acc in group["params"]])


def backward_weight(work: WeightWork, final: bool) -> None:
    """W: the weight gradients, from the intermediates' gradients that B kept."""
    for group in work.groups:
        edges, grads = [], []
        for grads_tuple, node in zip(group["grads"], group["intermediates"]):
            for i, grad in enumerate(grads_tuple or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue
        # Replay B's gradients at each intermediate, so that a path through two of them is not counted twice.
        handles = (
            [
                node.register_prehook(lambda _, saved=saved: saved)
                for saved, node in zip(group["grads"], group["intermediates"])
            ]
            if len(group["intermediates"]) > 1
            else []
        )
        params = [p for p in work.params if _node(p) in group["params"]]
        try:
            _run(edges, grads, [GradientEdge(_node(p), 0) for p in params], params, final)
        finally:
            for handle in handles:
                handle.remove()
    work.groups = []


def _roots(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    """The outputs that carry a graph, with their gradients (ones for a scalar loss)."""
    roots, grads = [], []
    for output, grad in zip(outputs, output_grads):
        if output.requires_grad and grad is not None or output.grad_fn is not None and output.dim() == 0:
            roots.append(output)
            grads.append(torch.ones_like(output) if grad is None else grad)
    return roots, grads


def _reachable(reverse: dict, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable parameters whose accumulators the graph (`reverse`, its reversed edges) reaches; the others
    get no gradient, as in a plain backward."""
    return [p for p in params if p.requires_grad and _get_grad_fn_or_grad_acc(p) in reverse]
