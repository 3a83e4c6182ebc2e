"""fastpipe: pipeline-parallel training for PyTorch.

``fastpipe.Pipe`` is a drop-in replacement for ``nn.Sequential`` that cuts the model into
stages and pipelines micro-batches through them (GPipe), with the same outputs and
gradients as the plain model.
"""

from fastpipe.batchnorm import DeferredBatchNorm
from fastpipe.distributed_pipe import DistributedPipe
from fastpipe.errors import PipelineError
from fastpipe.pipe import CHECKPOINT_MODES, Pipe
from fastpipe.serialization import load, save

__version__ = "0.1.0"

__all__ = ["Pipe", "DistributedPipe", "PipelineError", "DeferredBatchNorm", "CHECKPOINT_MODES", "save", "load",
           "__version__"]
