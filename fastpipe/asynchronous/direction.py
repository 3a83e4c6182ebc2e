"""The optimizer's current update direction, read from its own state, for weight prediction.

XPipe (Guan, Yin, Li, Lu 2019, arXiv 1911.04610) predicts the weights a stage will hold
when a micro-batch's gradient is applied, s updates from now, and runs the micro-batch's
forward and backward on that prediction. PipeOptim (arXiv 2312.00839) makes the prediction
follow the optimizer's own update rule::

    Ŵ = W - lr · s · Δ          Δ: the direction of the optimizer's next step

where Δ comes from the state the optimizer already keeps (no extra state is stored):

* ``torch.optim.SGD`` with momentum: the momentum buffer ``v`` (the step is ``lr · v``;
  weight decay and dampening are already folded into ``v``);
* ``torch.optim.Adam``: ``m̂ / (√v̂ + ε)`` with ``m̂ = m / (1 - β1^t)``, ``v̂ = v / (1 - β2^t)``
  (``v̂`` from the running maximum under ``amsgrad``; L2 weight decay is folded into m);
* ``torch.optim.AdamW`` (and Adam with ``decoupled_weight_decay=True``): the same plus the
  decoupled decay ``λ · W``.

``maximize=True`` needs nothing more: both optimizers negate the gradient before it enters
their state, so the step is still ``-lr · Δ``. A parameter without state yet (no update so far) has
Δ = 0: the prediction is the current weights.

Refused, with an error that says so: SGD without momentum (it keeps no direction), SGD with
``nesterov=True`` (its step adds the current gradient, which no state holds), and every
other optimizer class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

import fastpipe._C as _C

__all__ = ["SUPPORTED", "check_predictable", "predict_weights", "update_direction"]

SUPPORTED = "torch.optim.SGD (momentum > 0, nesterov=False), torch.optim.Adam, torch.optim.AdamW"


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless :func:`update_direction` knows ``optimizer``'s direction.

    Raises:
        ValueError: naming the supported optimizers and what to change.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"fastpipe: consistency='predict' needs the optimizer's update direction, which is known for "
            f"{SUPPORTED}; got {kind.__module__}.{kind.__qualname__}. Use one of those, or "
            "consistency='stash' / 'stale' / 'sync', which work with any optimizer"
        )
    if kind is torch.optim.SGD:
        for group in optimizer.param_groups:
            if not group.get("momentum", 0):
                raise ValueError(
                    "fastpipe: consistency='predict' with SGD needs momentum > 0: plain SGD keeps no update "
                    "direction to predict from; set momentum (e.g. 0.9) or use consistency='stash'"
                )
            if group.get("nesterov", False):
                raise ValueError(
                    "fastpipe: consistency='predict' does not support SGD(nesterov=True): its step adds the "
                    "current gradient, which the optimizer does not keep; use nesterov=False or Adam/AdamW"
                )


def _one_pass(*tensors: Tensor) -> bool:
    """Whether ``_C.adam_predict_f32`` can serve: contiguous fp32 host tensors of one size."""
    n = tensors[0].numel()
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n for t in tensors
    )


def _local(t: Tensor) -> Tensor:
    """What this rank holds of ``t``: a DTensor's shard (a stage sharded with FSDP2), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _steps(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> dict[int, float]:
    """Each parameter's Adam step count as a float, read with one device sync at most.

    Fused and capturable Adam keep ``state["step"]`` on the parameter's device, where a
    ``float()`` per parameter would wait for the device once each.
    """
    found = [(id(p), s["step"]) for p in params if "step" in (s := optimizer.state.get(p, {}))]
    on_device = [(key, t) for key, t in found if isinstance(t, Tensor) and t.device.type != "cpu"]
    out = {key: float(t) for key, t in found if not (isinstance(t, Tensor) and t.device.type != "cpu")}
    if on_device:
        values = torch.stack([t.reshape(()).float() for _, t in on_device]).cpu().tolist()
        out.update((key, v) for (key, _), v in zip(on_device, values))
    return out


@torch.no_grad()
def update_direction(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[Tensor | None]:
    """Δ for each of ``params`` (None where the optimizer holds no state for it yet).

    The caller has checked the optimizer with :func:`check_predictable`; the step it
    predicts is ``p ← p - lr · Δ``.
    """
    groups = _group_of(optimizer)
    decoupled = type(optimizer) is torch.optim.AdamW
    steps = _steps(optimizer, params)
    out: list[Tensor | None] = []
    for p in params:
        group, state = groups[id(p)], optimizer.state.get(p, {})
        if type(optimizer) is torch.optim.SGD:
            buf = state.get("momentum_buffer")
            out.append(None if buf is None else buf)
            continue
        if "exp_avg" not in state:
            out.append(None)
            continue
        step = steps[id(p)]
        beta1, beta2 = group["betas"]
        second = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        m_hat = state["exp_avg"] / (1 - beta1**step)
        v_hat = second / (1 - beta2**step)
        delta = m_hat / (v_hat.sqrt() + group["eps"])
        if decoupled or group.get("decoupled_weight_decay", False):
            delta = delta + group["weight_decay"] * p
        out.append(delta)
    return out


@torch.no_grad()
def predict_weights(
    optimizer: torch.optim.Optimizer,
    params: Sequence[Tensor],
    totals: Sequence[float],
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """Ŵ = p - total · Δ for each of ``params``, written into ``out`` (new tensors when None).

    For a DTensor parameter (a stage sharded with FSDP2) Ŵ is this rank's shard of the prediction,
    computed from the shards of the parameter and of the optimizer state.

    ``totals[i]`` is the sum of the learning rates of the updates to predict for ``params[i]``
    (``lr · s`` at a constant lr). Where the optimizer holds no state for a parameter yet,
    Ŵ is a copy of it. The arithmetic is :func:`update_direction`'s, rearranged so that no
    full-size temporary is made: the prediction runs on the critical path of every stage, once
    per mini-batch, and on a CPU each temporary of a stage's size costs as much as the
    prediction itself. For Adam, with c1 = 1 - β1^t and c2 = √(1 - β2^t)::

        m̂ / (√v̂ + ε) = (c2 / c1) · m / (√v + ε · c2)

    so Ŵ takes three passes (sqrt, add, addcdiv) into one buffer, against eight for the
    direction followed by the subtraction; for contiguous fp32 host tensors, one pass
    (``fastpipe._C.adam_predict_f32``).
    """
    if out is not None and len(out) != len(params):
        raise ValueError(f"fastpipe: {len(out)} output buffers for {len(params)} parameters")
    groups = _group_of(optimizer)
    kind = type(optimizer)
    steps = _steps(optimizer, params)
    result: list[Tensor] = []
    for i, (param, total) in enumerate(zip(params, totals)):
        group, state = groups.get(id(param)), optimizer.state.get(param, {})
        p = _local(param)
        o = torch.empty_like(p) if out is None else out[i]
        if group is None or not state:
            result.append(o.copy_(p))
            continue
        if kind is torch.optim.SGD:
            buf = state.get("momentum_buffer")
            result.append(o.copy_(p) if buf is None else torch.add(p, _local(buf), alpha=-total, out=o))
            continue
        step = steps[id(param)]
        beta1, beta2 = group["betas"]
        second = _local(state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"])
        c1, c2 = 1 - beta1**step, (1 - beta2**step) ** 0.5
        decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        decay = -total * group["weight_decay"] if decoupled else 0.0
        first = _local(state["exp_avg"])
        if _one_pass(o, p, first, second):
            _C.adam_predict_f32(
                o.data_ptr(),
                p.data_ptr(),
                first.data_ptr(),
                second.data_ptr(),
                o.numel(),
                -total * c2 / c1,
                group["eps"] * c2,
                decay,
            )
        else:
            torch.sqrt(second, out=o)
            o.add_(group["eps"] * c2)
            torch.addcdiv(p, first, o, value=-total * c2 / c1, out=o)
            if decay:
                o.add_(p, alpha=decay)
        result.append(o)
    return result
