"""Which calls and layers draw random numbers: the table :class:`~fastpipe.rng.streams.TaskRNG` routes by.

:data:`RANDOM_OPS` lists the torch calls that draw from a device's default generator when
given none (extensible with :func:`register_random_op`); :class:`~fastpipe.rng.streams.TaskRNG`
routes exactly these to the running task's stream.

**Cost only where there is randomness.** A ``TorchFunctionMode`` intercepts every op of its
thread (+38% host time on a 150-layer model of tiny Linears). :func:`may_draw` decides per
stage whether it could draw at all: a stage made only of ``torch.nn`` layers that never
draw (Linear, Conv, norms, activations, Embedding…; dropout-like layers only in eval), with
no hooks, runs without the mode and pays nothing. Anything fastpipe cannot see through
(a custom module's ``forward``, a hook, a loss given as a plain function) gets the mode;
:func:`register_deterministic` declares a custom layer that never draws, and a class may say
it itself, without importing fastpipe, with an attribute ``fastpipe_may_draw = False`` or a
method ``fastpipe_may_draw(self) -> bool`` (e.g. ``self.training and self.p > 0``); fastpipe's
kernels and the GPT of ``fastpipe train`` do. A loss object may declare it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_globals

__all__ = ["RANDOM_OPS", "register_random_op", "register_deterministic", "may_draw"]


def _vf(name: str) -> Any:
    """The ``torch._C._VariableFunctions`` op ``name``, or None where this torch build lacks it."""
    return getattr(torch._C._VariableFunctions, name, None)


# Calls that draw from a default generator when given none. Composites (SDPA, MHA, RReLU,
# gumbel-softmax, fractional pooling, nn.init) are listed as a whole: the mode does not see
# the draws nested inside them. RNN kernels draw for their inter-layer dropout.
RANDOM_OPS: set[Callable[..., Any]] = {
    f
    for f in (
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.binomial,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        _vf("_standard_gamma"),
        _vf("_sample_dirichlet"),
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.bernoulli_,
        Tensor.bernoulli,
        Tensor.random_,
        Tensor.exponential_,
        Tensor.geometric_,
        Tensor.log_normal_,
        Tensor.cauchy_,
        Tensor.multinomial,
        F.dropout,
        F.alpha_dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.feature_alpha_dropout,
        torch.dropout,
        torch.dropout_,
        torch.alpha_dropout,
        torch.alpha_dropout_,
        torch.feature_dropout,
        torch.feature_dropout_,
        torch.feature_alpha_dropout,
        torch.feature_alpha_dropout_,
        _vf("native_dropout"),
        _vf("_fused_dropout"),
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
        F.rrelu,
        F.rrelu_,
        torch.rrelu,
        torch.rrelu_,
        F.gumbel_softmax,
        F.fractional_max_pool2d,
        F.fractional_max_pool3d,
        F.fractional_max_pool2d_with_indices,
        F.fractional_max_pool3d_with_indices,
        _vf("lstm"),
        _vf("gru"),
        _vf("rnn_tanh"),
        _vf("rnn_relu"),
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.orthogonal_,
        nn.init.sparse_,
    )
    if f is not None
}


def register_random_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Route ``fn`` through the task's stream too (usable as a decorator).

    For a function that draws from torch's default generator without taking a
    ``generator=`` (a custom op, say) and that torch function modes see, i.e. a torch op,
    a ``torch.ops`` op, or a Python function that calls ``handle_torch_function``.
    """
    RANDOM_OPS.add(fn)
    return fn


# Layers that draw while training. Checked by exact type: a subclass may override forward.
_DRAW_WHEN_TRAINING: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.AlphaDropout,
        nn.FeatureAlphaDropout,
        nn.RReLU,
        nn.MultiheadAttention,
        nn.Transformer,
        nn.TransformerEncoder,
        nn.TransformerDecoder,
        nn.TransformerEncoderLayer,
        nn.TransformerDecoderLayer,
        nn.RNN,
        nn.LSTM,
        nn.GRU,
    }
)
_ALWAYS_DRAW: frozenset[type[nn.Module]] = frozenset({nn.FractionalMaxPool2d, nn.FractionalMaxPool3d})
_DETERMINISTIC: set[type[nn.Module]] = set()


def register_deterministic(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare that ``cls``'s forward never draws random numbers (usable as a decorator).

    Stages made only of such layers run without :class:`~fastpipe.rng.streams.TaskRNG`'s per-op interception.
    """
    _DETERMINISTIC.add(cls)
    return cls


def _declared(obj: Any) -> bool | None:
    """What ``obj``'s own ``fastpipe_may_draw`` (an attribute or a method) says, or None."""
    declared = getattr(type(obj), "fastpipe_may_draw", None)
    if declared is None:
        return None
    return bool(declared(obj)) if callable(declared) else bool(declared)


def _module_may_draw(m: nn.Module) -> bool:
    cls = type(m)
    if m._forward_hooks or m._forward_pre_hooks:  # arbitrary code
        return True
    declared = _declared(m)
    if declared is not None:
        return declared
    if cls in _DRAW_WHEN_TRAINING:
        return m.training
    if cls in _ALWAYS_DRAW:
        return True
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        return True  # initialises its weights (randomly) in its first forward
    return cls not in _DETERMINISTIC and not cls.__module__.startswith("torch.nn.modules.")


def may_draw(module: nn.Module, extra: Callable[..., Any] | None = None) -> bool:
    """Whether running ``module`` (then ``extra``, e.g. a loss) could draw random numbers.

    False only when fastpipe can see that nothing in it draws: every submodule is a
    ``torch.nn`` layer that does not draw in its current mode (or was registered with
    :func:`register_deterministic`), no hooks are set, and ``extra`` is None, such a
    module, or a function of ``torch.nn.functional`` that does not draw.
    """
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    if any(_module_may_draw(m) for m in module.modules()):
        return True
    if extra is None:
        return False
    if isinstance(extra, nn.Module):
        return may_draw(extra)
    declared = _declared(getattr(extra, "__self__", extra))  # a loss object, or one of its methods
    if declared is not None:
        return declared
    return getattr(extra, "__module__", None) != "torch.nn.functional" or extra in RANDOM_OPS
