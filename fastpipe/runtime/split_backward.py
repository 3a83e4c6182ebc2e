"""Splitting a stage's backward into an input-gradient part (B) and a weight part (W).

Zero-bubble schedules (Qi et al., 2023) run B as soon as the next stage's gradient
arrives, because the previous stage waits for it, and defer W to fill bubbles. Calling
``torch.autograd.grad`` twice over the same graph would redo most of B inside W. Instead:

* B runs the graph from the outputs to the stage's input leaves only. The engine then
  computes, in every node, only the outputs that lead to those leaves (e.g. an ``addmm``
  node computes ``grad_input`` but not ``grad_weight``). A pre-hook on each *frontier*
  node (one that B executes and that also feeds a parameter) records the gradient that
  flowed into it.
* W restarts the engine at those frontier nodes, with the recorded gradients, towards the
  parameters only. Each frontier node now computes just its weight outputs, and the
  parameter-only part of the graph runs for the first time::

        outputs ──▶ [addmm] ──grad_input──▶ ... ──▶ input leaf        (B)
                       │ (recorded grad_output)
                       └──grad_weight──▶ [T] ──▶ AccumulateGrad(w)     (W)

So B + W cost what one combined backward costs, plus a graph walk per micro-batch.

Plain ``nn.Linear`` layers skip the walk's machinery: under a split their forward runs as
:class:`~fastpipe.runtime.wgrad.DeferringLinear`, whose backward in B computes ``dx`` and
records ``(x, dy)``; W sums ``dyᵀ x`` into the running gradient inside the GEMM. The
weights and biases of the Linears that deferred in the forward (not those that fell back
to ``F.linear``, under autocast say) are *early* parameters here: B asks autograd for them
too, and gets only what reaches them by other paths (a weight tied to an embedding in the
same stage).
The step runner makes vector parameters (norm weights, other biases) early as well: their
gradients are reductions, cheap next to B's GEMMs, as in the zero-bubble paper's Megatron
implementation, which defers only the Linear weight GEMMs. Where no other parameter is left
for W (the walk's frontier is empty), B frees the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from fastpipe.runtime.wgrad import Deferred, apply_deferred

__all__ = ["WeightWork", "backward_inputs", "backward_weights"]


class WeightWork:
    """What B leaves for W: per root group, gradient roots and the parameters they own."""

    __slots__ = ("groups", "params", "keep", "early", "records")

    def __init__(
        self,
        groups: list[tuple[list[Any], list[Tensor], list[int]]],
        params: Sequence[Tensor],
        keep: Any,
        early: list[tuple[int, Tensor]] | None = None,
        records: Deferred | None = None,
    ) -> None:
        self.groups = groups  # (roots, root grads, indices into params)
        self.params = list(params)
        self.keep = keep  # outputs and retained graph, alive until W
        self.early = early or []  # (index, gradient) that B computed for early parameters
        self.records = records  # deferred Linear work (fastpipe.runtime.wgrad)


def _variable_of(node: Any) -> Tensor | None:
    return getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None


def backward_inputs(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor],
    leaves: Sequence[Tensor],
    params: Sequence[Tensor],
    *,
    early: Sequence[int] = (),
    records: Deferred | None = None,
) -> tuple[list[Tensor | None], WeightWork]:
    """B: gradients w.r.t. ``leaves``; returns them and the work W still has to do.

    ``early`` indexes parameters whose gradients B takes as well; so do those of the Linears
    that ``records`` says deferred in the forward (their GEMM work goes into it during B).
    """
    routed = records.routed if records is not None else set()
    early = sorted({*early, *(i for i, p in enumerate(params) if id(p) in routed)})
    early_set = set(early)
    late = [i for i in range(len(params)) if i not in early_set]
    b_leaves = [*leaves, *(params[i] for i in early)]
    leaf_ids = {id(t) for t in b_leaves}
    param_ids = {id(params[i]) for i in late}
    reach_leaf: dict[Any, bool] = {}
    reach_param: dict[Any, bool] = {}

    def walk(node: Any) -> None:
        # Iterative post-order walk: graphs of deep stages exceed Python's recursion limit.
        stack = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if n in reach_leaf:
                continue
            if not expanded:
                stack.append((n, True))
                stack.extend((nxt, False) for nxt, _ in n.next_functions if nxt is not None and nxt not in reach_leaf)
                continue
            var = _variable_of(n)
            children = [nxt for nxt, _ in n.next_functions if nxt is not None]
            reach_leaf[n] = (var is not None and id(var) in leaf_ids) or any(reach_leaf.get(c, False) for c in children)
            reach_param[n] = (var is not None and id(var) in param_ids) or any(
                reach_param.get(c, False) for c in children
            )

    roots_out: list[Any] = []
    roots_grad: list[Tensor] = []
    b_outputs: list[Tensor] = []
    b_grads: list[Tensor] = []
    for out, g in zip(outputs, grads):
        fn = out.grad_fn
        if fn is None:  # the output is itself a leaf (identity stage)
            if id(out) in param_ids:
                roots_out.append(out)
                roots_grad.append(g)
            else:
                b_outputs.append(out)
                b_grads.append(g)
            continue
        walk(fn)
        if reach_leaf[fn]:
            b_outputs.append(out)
            b_grads.append(g)
        elif reach_param[fn]:
            roots_out.append(out)
            roots_grad.append(g)

    # Frontier: nodes B executes (they reach a leaf) with an edge into a part of the graph
    # that reaches a parameter but no leaf.
    def param_only(n: Any) -> bool:
        return n is not None and reach_param.get(n, False) and not reach_leaf.get(n, False)

    frontier = [n for n, leads in reach_leaf.items() if leads and any(param_only(c) for c, _ in n.next_functions)]
    recorded: dict[Any, tuple[Tensor | None, ...]] = {}
    handles = []
    for n in frontier:

        def hook(grad_outputs: tuple[Tensor | None, ...], node: Any = n) -> None:
            recorded[node] = grad_outputs

        handles.append(n.register_prehook(hook))
    try:
        got: Sequence[Tensor | None] = [None] * len(b_leaves)
        if b_outputs and b_leaves:
            got = torch.autograd.grad(
                b_outputs, b_leaves, b_grads, retain_graph=bool(frontier or roots_out), allow_unused=True
            )
    finally:
        for h in handles:
            h.remove()
    leaf_grads = list(got[: len(leaves)])
    early_grads = [(i, g) for i, g in zip(early, got[len(leaves) :]) if g is not None]

    # W runs once per frontier node, towards only the parameters of its parameter-only
    # region: one call from all roots would also walk from an upstream frontier node down
    # the input path into a downstream one and count its gradient twice.
    index = {id(params[i]): i for i in late}
    groups: list[tuple[list[Any], list[Tensor], list[int]]] = []
    owners: dict[int, int] = {}
    if roots_out:
        owned = _params_below([o.grad_fn for o in roots_out if o.grad_fn is not None], param_ids)
        owned |= {id(o) for o in roots_out if o.grad_fn is None}
        groups.append((roots_out, roots_grad, sorted(index[i] for i in owned)))
    for n in frontier:
        grads_in = recorded.get(n, ())
        edges = [(GradientEdge(n, k), g) for k, g in enumerate(grads_in) if g is not None]
        if not edges:
            continue
        owned = _params_below([c for c, _ in n.next_functions if param_only(c)], param_ids)
        groups.append(([e for e, _ in edges], [g for _, g in edges], sorted(index[i] for i in owned)))
    for _, _, idx in groups:
        for i in idx:
            owners[i] = owners.get(i, 0) + 1
    if any(count > 1 for count in owners.values()):
        # A parameter fed from two places (tied weights inside the stage): fall back to one
        # exact pass over the retained graph.
        groups = [(list(outputs), list(grads), late)]
    return leaf_grads, WeightWork(groups, params, list(outputs), early_grads, records)


def _params_below(nodes: Sequence[Any], param_ids: set[int]) -> set[int]:
    found: set[int] = set()
    seen: set[Any] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        var = _variable_of(n)
        if var is not None and id(var) in param_ids:
            found.add(id(var))
        stack.extend(c for c, _ in n.next_functions)
    return found


def backward_weights(work: WeightWork, sums: list[Tensor | None]) -> None:
    """W: add the parameter gradients into ``sums``, one running sum per ``work.params`` entry."""

    def add(i: int, g: Tensor) -> None:
        prev = sums[i]
        sums[i] = g if prev is None else prev.add_(g)

    for roots, grads, idx in work.groups:
        if not idx:
            continue
        found = torch.autograd.grad(roots, [work.params[i] for i in idx], grads, allow_unused=True, retain_graph=True)
        for i, g in zip(idx, found):
            if g is not None:
                add(i, g)
    for i, g in work.early:
        add(i, g)
    if work.records is not None:
        apply_deferred(work.records, work.params, sums)
    work.groups, work.early, work.records = [], [], None
    work.keep = None
