"""One process per pipeline stage over ``torch.distributed``: what ``DistributedPipe`` runs on.

* :mod:`fastpipe.distributed.runtime`: :class:`~fastpipe.distributed.runtime.DistributedRuntime`,
  the step on each rank, through the same step core as one process (:mod:`fastpipe.runtime.step`).
* :mod:`fastpipe.distributed.rank_step`: what a rank reads before its actions run (sizes, seed,
  the schedule's digest).
* :mod:`fastpipe.distributed.ranks`, :mod:`fastpipe.distributed.backend`: what the ranks agree on
  before the first step; the backend that serves a device.
* :mod:`fastpipe.distributed.rank_stages`, :mod:`fastpipe.distributed.tie_group`: this rank's
  stages, and the groups of ranks that share a tied weight.
* :mod:`fastpipe.distributed.p2p`, :mod:`fastpipe.distributed.p2p_ordered`,
  :mod:`fastpipe.distributed.wire`: transports between ranks (tag-matched for gloo,
  order-matched for NCCL) and their wire format.
* :mod:`fastpipe.distributed.watchdog`: bounded waits and the abort channel.
* :mod:`fastpipe.distributed.dp_reduce`: data-parallel gradient buckets.
* :mod:`fastpipe.distributed.fsdp`, :mod:`fastpipe.distributed.fsdp_step`: stages sharded over
  their replicas with FSDP2 (``dp_shard="fsdp"``), gathered and reduced once per step.
"""

__all__: list[str] = []
