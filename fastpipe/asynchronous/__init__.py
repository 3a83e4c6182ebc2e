"""Training that owns the optimizer step: synchronous or asynchronous (XPipe) pipelines.

Entry point: :meth:`fastpipe.Pipe.fit` (a CLI can call :func:`fit` with the same
arguments). Consistency policies: :data:`POLICIES`; see :mod:`fastpipe.asynchronous.weights`
for what each one runs on and :mod:`fastpipe.asynchronous.direction` for weight prediction.
What a window holds per device: :func:`fit_devices`, checked against ``memory_limit`` by
:class:`FitMemoryGuard`.
"""

from fastpipe.asynchronous.direction import SUPPORTED, check_predictable, predict_weights, update_direction
from fastpipe.asynchronous.fit_limit import FitMemoryGuard
from fastpipe.asynchronous.fit_run import FitRun, fit
from fastpipe.asynchronous.memory import fit_devices, receive_buffer_bytes, update_temporaries, weight_copy_bytes
from fastpipe.asynchronous.weights import POLICIES

__all__ = [
    "POLICIES",
    "SUPPORTED",
    "FitMemoryGuard",
    "FitRun",
    "check_predictable",
    "fit",
    "fit_devices",
    "predict_weights",
    "receive_buffer_bytes",
    "update_direction",
    "update_temporaries",
    "weight_copy_bytes",
]
