"""The model side of a pipeline: cutting a Sequential into stages, and what its layers declare.

* :mod:`fastpipe.model.partition`: a Pipe's arguments checked, the Sequential cut into stages.
* :mod:`fastpipe.model.side_inputs`: ``takes``, ``fastpipe.Sequential``, ``broadcast``.
* :mod:`fastpipe.model.skips`: ``stash`` / ``pops`` and the route of each skip between stages.
* :mod:`fastpipe.model.skip_memory`: a skip's bytes and the stages that hold them.
* :mod:`fastpipe.model.ties`: weights that layers on several stages share.
* :mod:`fastpipe.model.batchnorm`: ``DeferredBatchNorm``, statistics over the whole mini-batch.

The public names are importable from ``fastpipe`` itself.
"""

__all__: list[str] = []
