"""Weight gradients of ``nn.Linear`` summed inside the GEMM, not after it.

Over a step's micro-batches autograd computes each Linear's weight gradient into a new
tensor, then ``AccumulateGrad`` adds it to ``.grad``: per micro-batch the GEMM writes the
full weight-sized result and the add reads two and writes one more. Accumulating in the
GEMM instead (``grad.addmm_(g.T, x)``, beta = 1) touches the sum once. Megatron-LM does the
same on GPUs (its "gradient accumulation fusion"). Measured on one 2048x512 weight, 32-row
micro-batches, 8 of them, one CPU thread: 6.6-7.0 ms with mm + add, 4.4-4.6 ms with addmm_.
On small weights the Python Function this takes costs more than the add it saves, so a CPU
stage sums in the GEMM only for weights of 2**17 elements or more (:func:`default_fuse_min`, the
pipe's ``wgrad_fuse_min``).

Only the step runner's combined backward (``BW``) uses it: that backward swaps each
parameter's running sum into ``.grad`` for the duration of the call, so writing ``.grad``
here is exactly what ``AccumulateGrad`` would have done. During a forward whose backward
will be a ``BW``, :func:`accumulating_linears` routes plain ``nn.Linear`` modules through
:class:`AccumulatingLinear`::

    x ──▶ [AccumulatingLinear] ──▶ y          forward: F.linear, saves x
    dx ◀──      │   dy                        backward: dx = dy @ W, db = sum(dy)
                └── W.grad.addmm_(dyᵀ, x)     no gradient flows to W's AccumulateGrad

A split backward (``B`` then ``W``, the zero-bubble schedules) defers the same GEMM instead:
during a forward whose backward is split, :class:`DeferringLinear` computes only ``dx`` in
B and leaves ``(x, dy)`` in the micro-batch's record list; W adds ``dyᵀ x`` into the running
sum with the same ``addmm_``. This is the zero-bubble paper's "weight gradient store"
(Qi et al., 2023, arXiv 2401.10241): W is a GEMM over saved operands, with no graph to walk.

Deferred work can also be batched: a K = 32-row ``addmm_`` into a 2048x512 running sum reads
and writes the whole sum for little arithmetic. Measured on the reference stages' weights, one
CPU thread, 8 sums cycling: 2.2-2.8 ms a GEMM for one 32-row micro-batch, 3.2 ms for two
micro-batches stacked into 64 rows. :class:`CarriedRecords` lets a W hand its records on to a
later W of the same stage (:func:`fastpipe.schedule.fuse.weight_batches` pairs them), which
runs one GEMM over both; the records stay alive until then, which costs activation memory
(the pipe's ``wgrad_batch`` says how many micro-batches a batch holds;
:func:`default_wgrad_batch` where it does not: 2 on a CPU).

Under autocast both run as autocast's own linear does: x, the weight and the bias are cast to
the autocast dtype, the GEMMs run in it, and each micro-batch's weight gradient is rounded to
that dtype, cast to the weight's and then added, which is exactly autograd's arithmetic there (so
such records are not stacked: one GEMM over two micro-batches would round their sum once).
Whatever autograd would do differently falls back to ``F.linear``: mixed dtypes outside
autocast, float64 under it, tensor subclasses, frozen weights. Parameter hooks are no reason to fall back: the
stage backwards run with them set aside, and they see the step's summed gradient (see
:mod:`fastpipe.runtime.param_hooks`). A pipe built with ``fused_wgrad=False`` leaves every
weight gradient to autograd (:mod:`fastpipe.runtime.options`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = [
    "AccumulatingLinear",
    "CarriedRecords",
    "DeferringLinear",
    "Deferred",
    "accumulating_linears",
    "apply_deferred",
    "default_fuse_min",
    "default_wgrad_batch",
    "fusable_linears",
    "summing_linears",
]


def default_wgrad_batch(device: torch.device) -> int:
    """How many micro-batches' deferred Linear work one W runs together on ``device``, unless the pipe says.

    2 on a CPU, where a micro-batch's GEMM is mostly the running sum's memory traffic
    (measured), and 1 elsewhere: on a GPU the batching is not measured yet, and micro-batches
    of many rows make the GEMM compute-bound while the carried records still cost memory.
    """
    return 2 if device.type == "cpu" else 1


def default_fuse_min(device: torch.device) -> int:
    """The fewest weight elements for which a Linear's combined backward sums in its GEMM on ``device``.

    2**17 on a CPU, 0 elsewhere. The fused path saves one weight-sized add per micro-batch and
    costs a Python autograd Function per call. Measured by ``bench/fused_wgrad_stage.py`` (one
    CPU thread, AMD EPYC, torch 2.13, 2026-12-02; GPT blocks, 8 micro-batches of 128 rows), the
    fused stage's step against autograd's, median of 10 paired rounds: at width 128 (weights of
    16-65 K elements) 1.02x, at width 256 (65-262 K) 0.97x, at width 512 (262 K-1 M) 0.93x; with
    ``torch.utils.checkpoint`` around each block 1.08x, 1.05x and 1.01x. On a GPU the add is a
    kernel launch and a pass over the sum, so every Linear fuses there, as Megatron-LM's gradient
    accumulation fusion does.
    """
    return 1 << 17 if device.type == "cpu" else 0


def summing_linears(linears: Sequence[nn.Linear], fuse_min: int) -> list[nn.Linear]:
    """Those of ``linears`` whose combined backward sums in the GEMM: a weight of ``fuse_min`` elements or more.

    A split backward defers every one of ``linears`` whatever its size: there the fused path is
    what makes W a GEMM over saved operands rather than a walk of a retained graph.
    """
    return [lin for lin in linears if lin.weight.numel() >= fuse_min]


class AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient straight into ``weight.grad``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)  # weight too: in-place changes before backward still raise
        ctx.param = weight  # the leaf itself, whose .grad is the running sum
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(_as(weight, x)) if ctx.needs_input_grad[0] else None
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            ctx.param.grad = _summed(ctx.param.grad, g2, x.reshape(-1, x.shape[-1]), weight)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b


def _as(weight: Tensor, x: Tensor) -> Tensor:
    """``weight`` in ``x``'s dtype: under autocast ``x`` is cast already, and the weight is cast as autocast would.

    The backward casts again rather than save the forward's copy: a weight-sized copy per
    micro-batch in flight would outweigh one cast per backward.
    """
    return weight if weight.dtype == x.dtype else weight.to(x.dtype)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` in ``x``'s dtype, with autocast off so that it casts nothing behind our back."""
    if weight.dtype == x.dtype:  # autocast, if on, would cast nothing either
        return F.linear(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, _as(weight, x), None if bias is None else _as(bias, x))


def _summed(running: Tensor | None, g2: Tensor, x2: Tensor, weight: Tensor) -> Tensor:
    """``running + g2ᵀ x2``, in place inside the GEMM where ``running`` allows it."""
    if g2.dtype != weight.dtype:
        # Autocast operands: the GEMM in their dtype, its result cast to the weight's, then
        # added, as autograd's cast node and AccumulateGrad do (addmm_ cannot mix dtypes).
        dw = g2.t().mm(x2).to(weight.dtype)
        return dw if running is None else _added(running, dw, weight)
    if running is None:
        return g2.t().mm(x2)
    if running.dtype == weight.dtype and running.device == weight.device and running.layout == torch.strided:
        return running.addmm_(g2.t(), x2)
    return running + g2.t().mm(x2)  # a sum autograd left in another form: add out of place, as AccumulateGrad would


def _added(running: Tensor, term: Tensor, param: Tensor) -> Tensor:
    if running.dtype == param.dtype and running.device == param.device and running.layout == torch.strided:
        return running.add_(term)
    return running + term


class Deferred:
    """A micro-batch's deferred Linear work.

    ``routed`` holds the ids of the weights and biases whose Linear took the deferring path
    in the forward (one that fell back, on mixed dtypes say, left its gradient to autograd);
    ``records`` one ``(weight, bias, x, dy)`` per Linear call that B ran.
    """

    __slots__ = ("routed", "records")

    def __init__(self) -> None:
        self.routed: set[int] = set()
        self.records: list[tuple[Tensor, Tensor | None, Tensor, Tensor]] = []


class DeferringLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes ``dx`` and defers the weight and bias gradients.

    The weight and bias get no gradient from autograd; their operands go into ``store`` for
    :func:`apply_deferred`. A node that the engine runs twice (B, then W restarting upstream
    of it for a LayerNorm's parameters) records once. ``dx`` is computed only where the
    engine will use it: in B the node may run for its weight alone.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, store: Deferred) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.bias, ctx.store, ctx.recorded = weight, bias, store, False
        ctx.x_fn = x.grad_fn
        return _linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        wanted = ctx.needs_input_grad[0] and (ctx.x_fn is None or torch._C._will_engine_execute_node(ctx.x_fn))
        grad_x = grad.matmul(_as(weight, x)) if wanted else None
        if not ctx.recorded:
            ctx.recorded = True
            # Detached: W runs outside the engine, where a GEMM over an input that still
            # requires grad would build a graph into the weight's gradient and keep every
            # record (and the stage's graph) alive until that gradient is dropped.
            ctx.store.records.append((ctx.param, ctx.bias, x.detach(), grad))
        return grad_x, None, None, None


def apply_deferred(store: Deferred, params: Sequence[Tensor], sums: list[Tensor | None]) -> None:
    """W for deferred Linears: add each record's weight and bias gradient into ``sums``.

    ``sums[i]`` is the running sum of ``params[i]``; records are consumed. Records of one
    Linear (its micro-batches carried together) go through one GEMM over their stacked rows.
    """
    with torch.no_grad():  # W runs outside the engine: nothing here is differentiated
        _apply_records(store, params, sums)


def _apply_records(store: Deferred, params: Sequence[Tensor], sums: list[Tensor | None]) -> None:
    index = {id(p): i for i, p in enumerate(params)}
    # Linears that share a weight may still have biases of their own (a tie of weights only).
    by_linear: dict[tuple[int, int], list[tuple[Tensor, Tensor | None, Tensor, Tensor]]] = {}
    for rec in store.records:
        by_linear.setdefault((id(rec[0]), id(rec[1])), []).append(rec)
    for recs in by_linear.values():
        if all(r[2].dtype == r[0].dtype for r in recs):
            _apply_stacked(recs, index, sums)
        else:  # autocast: autograd rounds each micro-batch's GEMM on its own, and so must W
            for rec in recs:
                _apply_stacked([rec], index, sums)
    store.records.clear()


def _apply_stacked(
    recs: list[tuple[Tensor, Tensor | None, Tensor, Tensor]], index: dict[int, int], sums: list[Tensor | None]
) -> None:
    weight, bias = recs[0][0], recs[0][1]
    g2s = [r[3].reshape(-1, r[3].shape[-1]) for r in recs]
    x2s = [r[2].reshape(-1, r[2].shape[-1]) for r in recs]
    g2 = g2s[0] if len(recs) == 1 else torch.cat(g2s)
    x2 = x2s[0] if len(recs) == 1 else torch.cat(x2s)
    i = index[id(weight)]
    sums[i] = _summed(sums[i], g2, x2, weight)
    if bias is not None and id(bias) in index:
        j = index[id(bias)]
        db = g2.sum(0).to(bias.dtype)
        prev = sums[j]
        sums[j] = db if prev is None else _added(prev, db, bias)


class CarriedRecords:
    """Deferred records on their way from one W to a later W of the same stage.

    Args:
        carry: each ``(stage, mb)`` whose W hands its records on, mapped to the W that runs
            them (:func:`fastpipe.schedule.fuse.weight_batches`).
    """

    def __init__(self, carry: Mapping[tuple[int, int], tuple[int, int]]) -> None:
        self.carry = carry
        self._pending: dict[tuple[int, int], list[tuple[Tensor, Tensor | None, Tensor, Tensor]]] = {}

    def take(self, key: tuple[int, int], store: Deferred | None) -> Deferred | None:
        """What W ``key`` applies now: its own records and those carried to it, or None if it hands them on."""
        carried = self._pending.pop(key, None)
        if store is None:  # this W's B deferred nothing of its own
            if carried is None:
                return None
            store = Deferred()
        if carried is not None:
            store.records[:0] = carried
        into = self.carry.get(key)
        if into is None:
            return store
        self._pending.setdefault(into, []).extend(store.records)
        store.records.clear()
        return None


def fusable_linears(module: nn.Module, params: Sequence[Tensor]) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``module`` whose weight is one of ``params``.

    Subclasses may override ``forward`` and are left alone, as are modules that already
    carry an instance-level ``forward``.
    """
    ids = {id(p) for p in params}
    return [m for m in module.modules() if type(m) is nn.Linear and id(m.weight) in ids and "forward" not in m.__dict__]


# The dtypes autocast casts to its own (it leaves float64 alone).
_AUTOCAST_CASTS = (torch.float16, torch.bfloat16, torch.float32)


def _compute_dtype(x: Tensor, weight: Tensor, bias: Tensor | None) -> torch.dtype | None:
    """The dtype the fused path runs ``F.linear(x, weight, bias)`` in, or None where it falls back."""
    if not (torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf):
        return None
    if type(x) is not Tensor or type(weight) not in (Tensor, nn.Parameter):
        return None
    if x.layout != torch.strided or x.device != weight.device or x.dim() < 1 or not weight.is_floating_point():
        return None
    if bias is not None and (type(bias) not in (Tensor, nn.Parameter) or bias.dtype != weight.dtype):
        return None
    if not torch.is_autocast_enabled(x.device.type):
        return weight.dtype if x.dtype == weight.dtype else None
    if x.dtype not in _AUTOCAST_CASTS or weight.dtype not in _AUTOCAST_CASTS:
        return None
    return torch.get_autocast_dtype(x.device.type)


def _forward(self: nn.Linear, store: Deferred | None, x: Tensor) -> Tensor:
    dtype = _compute_dtype(x, self.weight, self.bias)
    if dtype is not None:
        # The cast of x is autograd's, as under autocast: dx comes back cast to x's dtype.
        x = x.to(dtype)
        if store is None:
            return AccumulatingLinear.apply(x, self.weight, self.bias)
        store.routed.update(id(t) for t in (self.weight, self.bias) if t is not None)
        return DeferringLinear.apply(x, self.weight, self.bias, store)
    return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def accumulating_linears(linears: Sequence[nn.Linear], defer_to: Deferred | None = None) -> Iterator[None]:
    """Within the block, ``linears`` accumulate their weight gradients in the GEMM.

    Without ``defer_to`` the block must be a forward whose backward runs with each weight's
    running sum in ``.grad`` (the step runner's ``BW``); other backwards would find the
    weight gradient already added, not returned. With it, the backward leaves the weight
    work in ``defer_to`` for :func:`apply_deferred` (a split ``B``/``W``).
    """
    patched = []
    try:
        for lin in linears:
            if "forward" not in lin.__dict__:
                lin.forward = functools.partial(_forward, lin, defer_to)  # type: ignore[method-assign]
                patched.append(lin)
        yield
    finally:
        for lin in patched:
            del lin.__dict__["forward"]
