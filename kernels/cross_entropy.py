"""Linear + cross-entropy without materialising the full ``[tokens, vocab]`` logits.

GEMMs run in the compute dtype (the input's, or autocast's), so bf16/fp16 inputs use the tensor
cores with fp32 accumulation; an fp32 GEMM on Hopper runs at a small fraction of that rate.
Two strategies (``configs.launch_config("lce")``; the GPU tuner measures both)::

    "recompute" (default)                         "accumulate"
    pass 1, token chunks of C rows:               token chunks of C rows:
      z   = x_c @ W^T + b      [C, V] buffer        z = x_c @ W^T + b
      loss, lse; z := dloss/dz in place             loss; z := dloss/dz in place
      dx_c = z @ W             (complete)           dx_c = z @ W
    pass 2, vocab blocks of Vb columns:             dW32 += z^T @ x_c   (fp32 accumulator)
      z   = x @ W_b^T + b_b    same buffer          db32 += sum(z)
      z := (exp(z - lse) - onehot) * s
      dW_b = z^T @ x           (complete)
      db_b = sum(z)

"recompute" spends a fourth GEMM (logits twice) to write every gradient once, with fp32
accumulation inside one GEMM: exact as eager, and no vocab-sized accumulator, so its peak memory
is the gradients plus one logits buffer (Liger-Kernel's, whose dW accumulates in the weight's
dtype chunk by chunk). "accumulate" runs three GEMMs but holds an fp32 ``[V, H]`` accumulator
(2x a bf16 weight). Cut Cross-Entropy (Wijmans et al., 2024) also recomputes logits blockwise.

For ``reduction="mean"|"sum"``, dx and db are computed in forward and kept; backward scales
them by the incoming scalar in place (so it runs once). dW waits for backward under "recompute":
pass 2 runs there from the saved log-sum-exps, the same GEMMs as right after pass 1, so no
weight-sized gradient is held from forward to backward (M micro-batches in flight in a
pipeline's forward phase held M of them). "accumulate" has dW from pass 1 and keeps it, as
its fp32 accumulator already costs weight-sized memory. For ``reduction="none"``, and for fp16
(whose gradients would underflow before a GradScaler's factor arrives), forward computes only
the losses; backward reruns the passes with the per-token scales.

Backward computes only the gradients the engine will deliver. A pipeline's split backward
runs this node twice: B asks for the input gradient alone, W for the weight's::

    B:  loss ──▶ [LCE backward] ──dx──▶ previous layers          pass 2 (dW) skipped
    W:  loss ──▶ [LCE backward] ──dW──▶ AccumulateGrad(weight)   pass 2 runs here

so the two vocabulary-sized GEMMs of dW stay off B, the critical path of the last stage,
which the zero-bubble schedules count on, and no dW is held from B to W.
"""

from __future__ import annotations

from typing import Any

import torch

from ._ce_passes import run as _run
from ._ce_passes import weight_grad as _weight_grad
from ._common import autocast_like, autocast_state
from ._gemm import OUT_DTYPE_MM as _OUT_DTYPE_MM  # noqa: F401 - bench/kernel_tune.py reports it
from ._gemm import chunk_size as _chunk_size  # noqa: F401 - the tests check its rule here
from ._gemm import compute_dtype as _compute_dtype
from .configs import launch_config

__all__ = ["linear_cross_entropy"]


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None,
        ignore_index: int,
        reduction: str,
        chunk_size: int | None,
    ) -> torch.Tensor:
        hidden = x.shape[-1]
        cdt = _compute_dtype(x)
        x2 = x.reshape(-1, hidden).to(cdt)
        tgt = target.reshape(-1).contiguous()
        n = x2.shape[0]
        need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
        # fp16 has 5 exponent bits: (softmax - onehot) / n_valid rounded into the fp16 chunk flushes
        # most off-target gradients to zero (60% at V=32k, 1,024 tokens) before a GradScaler's factor
        # could lift them. So for fp16 the gradients wait for backward, where the upstream gradient
        # (that factor) is folded into each row's scale before anything is rounded, as in eager.
        deferred = reduction != "none" and cdt == torch.float16
        grad_now = reduction != "none" and not deferred and (need_dx or need_dw or need_db)
        # dW later, in backward (see the module docstring): free under "recompute".
        dw_later = grad_now and need_dw and launch_config("lce", x.device)["strategy"] == "recompute"
        n_valid = (tgt != ignore_index).sum()
        scale = None
        if grad_now:
            s = 1.0 / n_valid.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=x.device)
            scale = s.expand(n).contiguous()  # the kernels read one scale per row
        ctx.meta = (x.shape, x.dtype, reduction, ignore_index, chunk_size, deferred)
        ctx.autocast = autocast_state(x)
        ctx.scaled_by = None  # the upstream gradient the saved gradients were scaled by, once
        ctx.dw_later = dw_later
        w, b = weight.to(cdt), bias.to(cdt) if bias is not None else None
        needs = (need_dx, need_dw and not dw_later, need_db)
        with torch.autocast(x.device.type, enabled=False):
            losses, lse, dx, dw, db = _run(x2, w, b, tgt, ignore_index, scale, needs, chunk_size)
        if dw_later:
            ctx.save_for_backward(x, weight, tgt, bias)
            ctx.n_valid, ctx.lse = n_valid, lse
        if reduction == "none":
            ctx.save_for_backward(x, weight, tgt, bias)
            return losses.view(target.shape).to(x.dtype)
        if deferred:
            ctx.save_for_backward(x, weight, tgt, bias)
            ctx.n_valid = n_valid
            total = losses.sum()
            return (total / n_valid if reduction == "mean" else total).to(x.dtype)
        # Kept on ctx rather than saved for backward: backward scales them in place, which
        # the saved-tensor version check would refuse on a second backward (see _scaled_grads).
        ctx.grads = (
            dx.view(x.shape).to(x.dtype) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None and bias is not None else None,
        )
        total = losses.sum()
        return (total / n_valid if reduction == "mean" else total).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with autocast_like(ctx.autocast):  # replay forward's autocast, whatever the device
            return _LinearCrossEntropyFn._backward(ctx, g)

    @staticmethod
    def _wanted(ctx: Any) -> tuple[bool, bool, bool]:
        """Whether the engine will deliver the gradient of x, weight and bias in this run.

        ``needs_input_grad`` is fixed at forward; a ``torch.autograd.grad`` towards some inputs
        only (a split backward's B or W) runs this node while leaving the others' edges dead,
        so their GEMMs would be thrown away.
        """
        nodes = [fn for fn, _ in ctx.next_functions]  # one per tensor input: x, weight, target[, bias]
        need = ctx.needs_input_grad
        bias_node = nodes[3] if len(nodes) > 3 else None

        def runs(node: Any) -> bool:
            if node is None:
                return False
            try:
                return bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:
                # Raised for a leaf that ``torch.autograd.grad`` captures, i.e. one whose
                # gradient it returns: wanted. Any other refusal computes the gradient too.
                return True

        return need[0] and runs(nodes[0]), need[1] and runs(nodes[1]), need[3] and runs(bias_node)

    @staticmethod
    def _scaled_grads(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradients forward computed, times the upstream gradient ``g``.

        The first call scales them in place: they are ours alone (saved by forward), and a copy
        would double the weight-sized memory at the peak. A later call (``retain_graph``, or a
        pipeline's split backward, whose weight pass runs this node again with the same ``g``)
        gets them again, rescaled out of place when ``g`` changed; if something wrote into the
        tensors handed out the first time, they are gone, and that is refused.
        """
        grads = ctx.grads
        if ctx.scaled_by is None:
            g32 = g.float()
            for t in grads:
                if t is not None:
                    t.mul_(g32)
            # The engine's own ``g``, not a converted copy: the identity test below then holds
            # when the node runs again, and the host does not sync on a comparison.
            ctx.scaled_by = (g, [t._version if t is not None else 0 for t in grads])
        else:
            first, versions = ctx.scaled_by
            if any(t is not None and t._version != v for t, v in zip(grads, versions)):
                raise RuntimeError(
                    "linear_cross_entropy hands out the gradients it computed in forward, and they were "
                    "modified after its first backward, so it cannot backpropagate again; use "
                    "reduction='none' (then .sum()/.mean()) to backpropagate through it more than once"
                )
            if first is not g and not torch.equal(first, g):  # `is`: no device sync when unchanged
                if not bool(first != 0):
                    raise RuntimeError(
                        "linear_cross_entropy's first backward had a zero upstream gradient, which erased "
                        "the gradients it computed in forward; use reduction='none' to backpropagate again"
                    )
                ratio = g.float() / first.float()
                grads = tuple(t * ratio.to(t.dtype) if t is not None else None for t in grads)
        dx, dw, db = grads
        return dx, dw, None, db, None, None, None

    @staticmethod
    def _later_dw(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        """dW for the upstream gradient ``g``, by pass 2 from forward's log-sum-exps."""
        shape, _, reduction, ignore_index, chunk_size, _ = ctx.meta
        x, weight, tgt, bias = ctx.saved_tensors
        cdt = _compute_dtype(x)
        x2 = x.reshape(-1, shape[-1]).to(cdt)
        g32 = g.float() / ctx.n_valid.clamp(min=1).float() if reduction == "mean" else g.float()
        scale = g32.expand(tgt.numel()).contiguous()  # fp32, folded in before anything is rounded
        w, b = weight.to(cdt), bias.to(cdt) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return _weight_grad(x2, w, b, tgt, ignore_index, scale, ctx.lse, chunk_size).to(weight.dtype)

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, x_dtype, reduction, ignore_index, chunk_size, deferred = ctx.meta
        need_dx, need_dw, need_db = _LinearCrossEntropyFn._wanted(ctx)
        if reduction != "none" and not deferred:
            dx, dw, _, db, *rest = _LinearCrossEntropyFn._scaled_grads(ctx, g)
            if ctx.dw_later:
                dw = _LinearCrossEntropyFn._later_dw(ctx, g) if need_dw else None
            return dx, dw, None, db, *rest
        x, weight, tgt, bias = ctx.saved_tensors
        hidden = shape[-1]
        cdt = _compute_dtype(x)
        x2 = x.reshape(-1, hidden).to(cdt)
        w, b = weight.to(cdt), bias.to(cdt) if bias is not None else None
        if reduction == "none":
            scale = g.reshape(-1).float().contiguous()
        else:  # deferred: the upstream scalar (and 1 / n_valid for a mean) for every row, in fp32
            g32 = g.float() / ctx.n_valid.clamp(min=1).float() if reduction == "mean" else g.float()
            scale = g32.expand(tgt.numel()).contiguous()
        with torch.autocast(x.device.type, enabled=False):
            _, _, dx, dw, db = _run(x2, w, b, tgt, ignore_index, scale, (need_dx, need_dw, need_db), chunk_size)
        return (
            dx.view(shape).to(x_dtype) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            None,
            db.to(bias.dtype) if db is not None and bias is not None else None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(x @ weight.T + bias, target)`` without materialising the full logits.

    Args:
        x: hidden states ``[..., H]``.
        weight: ``[V, H]`` (the LM head / tied embedding).
        target: class indices, ``x.shape[:-1]``.
        bias: ``[V]`` or None.
        ignore_index: targets equal to this contribute no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"``.
        chunk_size: tokens per chunk; by default the logits chunk is about the size of ``x``
            (at least 256 tokens).

    Returns:
        The loss, as ``torch.nn.functional.cross_entropy`` would return it.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} != x.shape[:-1] {tuple(x.shape[:-1])}")
    return _LinearCrossEntropyFn.apply(x, weight, target, bias, ignore_index, reduction, chunk_size)
