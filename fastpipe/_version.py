"""fastpipe's version: the one place it is written (setup.py reads it from this file)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
