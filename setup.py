"""Build script for fastpipe.

The package is pure Python except for ``fastpipe._C`` (csrc/), a small pybind11
extension that links no torch, no cudart and no CUDA toolkit: the CUDA driver is
loaded at run time. That keeps ``pip install .`` fast and lets one build serve CPU-only
and CUDA hosts.
"""

from setuptools import setup

setup(
    name="fastpipe",
    version="0.1.0",
    description="Pipeline-parallel training for PyTorch: GPipe done right",
    packages=["fastpipe", "fastpipe.runtime", "fastpipe.schedule", "fastpipe.kernels"],
    package_dir={"fastpipe.kernels": "kernels"},
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "tqdm"],
    extras_require={
        "kernels": ["triton", "numpy"],
        "plot": ["matplotlib"],
        "test": ["pytest", "numpy"],
    },
)
