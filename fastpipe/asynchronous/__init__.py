"""Training that owns the optimizer step: synchronous or asynchronous (XPipe) pipelines.

Entry point: :meth:`fastpipe.Pipe.fit` (a CLI can call :func:`fit` with the same
arguments). Consistency policies: :data:`POLICIES`; see
:mod:`fastpipe.asynchronous.weights` for what each one runs on and
:mod:`fastpipe.asynchronous.direction` for weight prediction.
"""

from fastpipe.asynchronous.direction import SUPPORTED, check_predictable, predict_weights, update_direction
from fastpipe.asynchronous.fit_run import FitRun, fit
from fastpipe.asynchronous.memory import weight_copy_bytes
from fastpipe.asynchronous.weights import POLICIES

__all__ = [
    "POLICIES",
    "SUPPORTED",
    "FitRun",
    "check_predictable",
    "fit",
    "predict_weights",
    "update_direction",
    "weight_copy_bytes",
]
