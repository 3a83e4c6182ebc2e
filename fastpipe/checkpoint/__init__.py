"""Checkpoints: the model, the optimizer and the RNG state, saved so that any layout loads them.

* :mod:`fastpipe.checkpoint.serialization`: ``fastpipe.save`` / ``fastpipe.load``, one file keyed
  like the ``nn.Sequential``, written atomically.
* :mod:`fastpipe.checkpoint.shards`: a rank's share of a sharded checkpoint, as a flat dict.
* :mod:`fastpipe.checkpoint.dcp`: sharded checkpoints through ``torch.distributed.checkpoint``.
* :mod:`fastpipe.checkpoint.commit`: commit records; a folder counts once its record is in place.
* :mod:`fastpipe.checkpoint.loop`: ``save_checkpoint`` / ``resume_or_start`` for a training loop.

The public names are importable from ``fastpipe`` itself.
"""

__all__: list[str] = []
