"""Build script for fastpipe.

The package is pure Python except for ``fastpipe._C`` (csrc/), a small pybind11
extension that links no torch, no cudart and no CUDA toolkit: the CUDA driver is
loaded at run time. That keeps ``pip install .`` fast and lets one build serve CPU-only
and CUDA hosts.
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the few translation units in parallel (env NPY_NUM_BUILD_JOBS overrides).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext_modules = [
    Pybind11Extension(
        "fastpipe._C",
        sorted(glob("csrc/*.cpp")),
        include_dirs=["csrc"],
        depends=sorted(glob("csrc/*.h")),
        cxx_std=17,
        extra_compile_args=["-O3", "-fno-math-errno", "-pthread"],
        extra_link_args=["-pthread"],
        libraries=["dl"],
    ),
]

setup(
    name="fastpipe",
    version="0.1.0",
    description="Pipeline-parallel training for PyTorch: GPipe done right",
    packages=["fastpipe", "fastpipe.runtime", "fastpipe.schedule", "fastpipe.asynchronous", "fastpipe.kernels",
              "fastpipe.train", "fastpipe.bench", "fastpipe.balance"],
    package_dir={"fastpipe.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    package_data={"fastpipe": ["_C.pyi"]},
    entry_points={"console_scripts": ["fastpipe=fastpipe.cli:main"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "tqdm",
        # Triton ships Linux wheels only; elsewhere fastpipe.kernels uses its PyTorch path.
        "triton; platform_system == 'Linux'",
        # The Triton interpreter (TRITON_INTERPRET=1, CPU tests) needs numpy.
        "numpy",
        # `fastpipe train` and `fastpipe bench` write PNG charts (loss curve, timeline, results),
        # and the README's first command is `pip install . && fastpipe train`.
        "matplotlib",
    ],
    extras_require={
        "plot": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "matplotlib", "hypothesis"],
        # scikit-learn: bench/xpipe_convergence.py trains on the digits data set it ships.
        "bench": ["matplotlib", "torchgpipe", "scikit-learn"],
    },
)
