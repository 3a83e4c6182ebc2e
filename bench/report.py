"""Writing a benchmark's result file; the code lives in :mod:`fastpipe.bench.report`."""

from fastpipe.bench.report import write_json

__all__ = ["write_json"]
