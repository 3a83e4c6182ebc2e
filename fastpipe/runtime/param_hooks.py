"""Parameter hooks see the step's gradient once, as under a plain ``loss.backward()``.

A stage's backward runs once per micro-batch; left alone, a hook registered on a
parameter (``p.register_hook``, ``p.register_post_accumulate_grad_hook``) would run on
every micro-batch's share and, on ``Pipe.forward``'s path, once more when the pipeline's
autograd node hands the summed gradient to the parameter: a hook that scales its gradient
by 2 scaled the result by 4. The stage backwards therefore run with the hooks set aside
(:func:`hooks_set_aside`), and the summed gradient passes through them once: by autograd
on ``Pipe.forward``'s path, by :func:`accumulate_grads` after ``train_step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["accumulate_grad", "accumulate_grads", "hooks_set_aside"]


def _hook_dicts(p: Tensor) -> list[dict]:
    # Autograd keeps a reference to these very dicts; emptying and refilling them in place
    # disables and restores the hooks without re-registering anything.
    dicts = (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None))
    return [d for d in dicts if d]


@contextlib.contextmanager
def hooks_set_aside(params: Sequence[Tensor]) -> Iterator[None]:
    """Within the block, ``params``' gradient hooks do not run."""
    saved = [(d, dict(d)) for p in params for d in _hook_dicts(p)]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, hooks in saved:
            d.update(hooks)


def accumulate_grad(p: Tensor, grad: Tensor) -> None:
    """Add ``grad`` into ``p.grad`` the way autograd's AccumulateGrad would, hooks included.

    Tensor hooks run first and may replace the gradient; post-accumulate hooks run last
    with the parameter.
    """
    for hook in list((p._backward_hooks or {}).values()):
        replaced = hook(grad)
        if replaced is not None:
            grad = replaced
    with torch.no_grad():
        p.grad = grad if p.grad is None else p.grad.add_(grad)
    for post in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
        post(p)


def accumulate_grads(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """:func:`accumulate_grad` for each parameter that has a gradient (None: unused this step)."""
    for p, g in zip(params, grads):
        if g is not None:
            accumulate_grad(p, g)
