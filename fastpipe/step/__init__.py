"""The rules of a training step, shared by ``Pipe``, ``DistributedPipe`` and ``fit``.

* :mod:`fastpipe.step.microbatch`: a mini-batch split into micro-batches and joined again.
* :mod:`fastpipe.step.rules`: ``chunks``, the checkpoint predicate, the schedule, loss weighting.
* :mod:`fastpipe.step.token_loss`: a mean loss that declares its normaliser (``token_loss``).
* :mod:`fastpipe.step.amp`: loss scaling (``GradScaler``) inside ``train_step``.
* :mod:`fastpipe.step.host_io`: a step's values moved to a GPU without blocking, read back once.
* :mod:`fastpipe.step.auto_schedule`: ``schedule="auto"``, measured once, then searched.

The step's execution, the action handlers every driver runs, is :mod:`fastpipe.runtime.step`.
"""

__all__: list[str] = []
