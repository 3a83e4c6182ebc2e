"""Device memory: measuring it, and (in sibling modules) modelling it.

Modules:

* :mod:`fastpipe.memory.accounting`: :class:`~fastpipe.memory.accounting.PeakMeter` and
  :func:`~fastpipe.memory.accounting.measure_peak`, a block's exact peak bytes on a device,
  with parameters, gradients and optimizer state split out (CUDA from the caching allocator's
  statistics, CPU from the counter below).
* :mod:`fastpipe.memory._cpu_counter`: an exact, process-wide count of CPU storage bytes from
  every thread, a counting wrapper of c10's CPU allocator built on first use.
* :mod:`fastpipe.memory.model`: the predicted per-device byte timeline of a schedule.
* :mod:`fastpipe.memory.stage_bytes`: what each stage holds for one micro-batch, measured.
* :mod:`fastpipe.memory.sizes`: byte sizes as people write them (``"24GiB"``).
* :mod:`fastpipe.memory.candidates`: the schedule search's candidates judged in device bytes.

Nothing is imported here, so importing the package builds and installs nothing.
"""

__all__: list[str] = []
