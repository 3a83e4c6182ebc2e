"""The installed fastpipe's version, read from its package metadata (setup.py holds the one number)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("fastpipe")
except PackageNotFoundError:  # a source tree on sys.path that was never installed has no metadata
    __version__ = "0+unknown"
