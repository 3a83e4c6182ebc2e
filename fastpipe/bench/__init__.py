"""The benchmark suite behind ``fastpipe bench`` (importable after ``pip install .``)."""
