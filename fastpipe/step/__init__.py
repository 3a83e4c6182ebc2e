"""The rules of a training step, shared by ``Pipe``, ``DistributedPipe`` and ``fit``.

* :mod:`fastpipe.step.microbatch`: a mini-batch split into micro-batches and joined again.
* :mod:`fastpipe.step.rules`: ``chunks``, the checkpoint predicate, the schedule, loss weighting.
* :mod:`fastpipe.step.amp`: loss scaling (``GradScaler``) inside ``train_step``.
* :mod:`fastpipe.step.auto_schedule`: ``schedule="auto"``, measured once, then searched.

The step's execution, the action handlers every driver runs, is :mod:`fastpipe.runtime.step`.
"""

__all__: list[str] = []
