"""What ran where and when: timelines, the costs measured from them, and charts.

* :mod:`fastpipe.trace.timeline`: :class:`~fastpipe.trace.timeline.Timeline`, the events that the
  simulator and the runtimes record; Chrome trace and Gantt chart.
* :mod:`fastpipe.trace.timing`: per-action costs from a measured timeline, and the simulator's
  prediction from them.
* :mod:`fastpipe.trace.plotting`: matplotlib on the Agg backend, for every chart fastpipe writes.
"""

__all__: list[str] = []
