"""fastpipe: pipeline-parallel training for PyTorch.

``fastpipe.Pipe`` is a drop-in replacement for ``nn.Sequential`` that cuts the model into
stages and pipelines micro-batches through them (GPipe), with the same outputs and
gradients as the plain model.
"""

# ruff: noqa: E402 - the source-tree finder must be in place before the package's own imports.

from pathlib import Path

from fastpipe import _source_tree
from fastpipe._version import __version__

# Run from a clone's source tree, fastpipe.kernels (the top-level kernels/ folder) and an unbuilt
# fastpipe._C need a finder of their own; an installed package has both and is left alone.
_source_tree.install(Path(__file__).parent, __version__)

from fastpipe.checkpoint.commit import CheckpointCorruptError, CheckpointError, CheckpointKeyError, latest
from fastpipe.checkpoint.loop import resume_or_start, save_checkpoint
from fastpipe.checkpoint.serialization import load, save
from fastpipe.distributed.launch import init_distributed
from fastpipe.distributed_pipe import DistributedPipe
from fastpipe.errors import PipelineError
from fastpipe.memory.host_optimizer import HostOptimizer
from fastpipe.model.batchnorm import DeferredBatchNorm
from fastpipe.model.side_inputs import Sequential, broadcast, takes
from fastpipe.model.skips import pops, stash
from fastpipe.pipe import CHECKPOINT_MODES, Pipe
from fastpipe.step.auto_schedule import AutoSchedule
from fastpipe.step.rules import TokenLoss, token_loss

# torchgpipe's name, for `from torchgpipe import GPipe` -> `from fastpipe import GPipe`: Pipe takes
# GPipe's arguments (module, balance, devices, chunks, checkpoint, deferred_batch_norm) with their
# meanings, and keeps its forward/backward contract.
GPipe = Pipe

__all__ = [
    "Pipe",
    "GPipe",
    "AutoSchedule",
    "DistributedPipe",
    "init_distributed",
    "PipelineError",
    "DeferredBatchNorm",
    "HostOptimizer",
    "CHECKPOINT_MODES",
    "save",
    "load",
    "save_checkpoint",
    "resume_or_start",
    "latest",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointKeyError",
    "Sequential",
    "takes",
    "broadcast",
    "stash",
    "pops",
    "token_loss",
    "TokenLoss",
    "__version__",
]
