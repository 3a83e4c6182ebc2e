"""Triton kernels that make recomputation cheap (installed as ``fastpipe.kernels``).

Each op saves only what its backward needs and recomputes the rest. CUDA tensors (or any tensor
when ``TRITON_INTERPRET=1``) run the Triton kernels; other tensors run a PyTorch path with the
same saving strategy. This package imports nothing from the rest of fastpipe and works
without triton installed.
"""

from ._common import HAS_TRITON
from .bias_gelu import bias_gelu
from .cross_entropy import linear_cross_entropy
from .dropout import dropout
from .fused_linear import bias_gelu_linear, layer_norm_linear, rms_norm_linear
from .layer_norm import add_dropout_layer_norm, add_dropout_rms_norm
from .mlp import MLPBlock
from .modules import GELU, Dropout, LayerNorm, RMSNorm
from .patch import patch
from .swiglu import swiglu

__all__ = [
    "HAS_TRITON",
    "add_dropout_layer_norm",
    "add_dropout_rms_norm",
    "bias_gelu",
    "swiglu",
    "dropout",
    "linear_cross_entropy",
    "layer_norm_linear",
    "rms_norm_linear",
    "bias_gelu_linear",
    "LayerNorm",
    "RMSNorm",
    "Dropout",
    "GELU",
    "MLPBlock",
    "patch",
]
