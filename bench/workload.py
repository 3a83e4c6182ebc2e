"""The reference workload; the code lives in :mod:`fastpipe.bench.workload` (installed with fastpipe)."""

from fastpipe.bench.workload import BATCH, BLOCKS, CHUNKS, FFN, HIDDEN, ResidualMLP, make_batch, make_model

__all__ = ["ResidualMLP", "make_model", "make_batch", "HIDDEN", "FFN", "BLOCKS", "BATCH", "CHUNKS"]
