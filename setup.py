"""Build script for fastpipe.

The package is pure Python except for ``fastpipe._C`` (csrc/), a small pybind11
extension that links no torch, no cudart and no CUDA toolkit: the CUDA driver is
loaded at run time. That keeps ``pip install .`` fast and lets one build serve CPU-only
and CUDA hosts.
"""

import re
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

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

# The top-level kernels/ folder is installed as fastpipe.kernels; every other package is found
# under fastpipe/, so a new subpackage ships without an edit here.
packages = find_packages(include=["fastpipe", "fastpipe.*"])
packages += ["fastpipe.kernels"] + [f"fastpipe.kernels.{name}" for name in find_packages("kernels")]

# triton is an extra, not a dependency: it is about 1 GB, and a CPU-only host runs the PyTorch path
# of fastpipe.kernels instead. GPU hosts have it anyway (CUDA builds of torch on Linux depend on it).
# Triton ships Linux wheels only.
triton = ["triton; platform_system == 'Linux'"]

# fastpipe.hf (HuggingFace causal LMs as a Pipe-ready Sequential) needs transformers 5, whose
# configs carry the base_model_pp_plan the adapter reads. Never add torchvision here: transformers
# imports it when present, and the only wheels served on CPU hosts are CUDA builds that fail to load.
hf = ["transformers>=5"]

# The version is written once, in fastpipe/_version.py; read as text (importing fastpipe needs torch).
_version_file = Path(__file__).with_name("fastpipe") / "_version.py"
version = re.search(r'^__version__ = "([^"]+)"$', _version_file.read_text(encoding="utf-8"), re.M)
assert version is not None, f"no __version__ line in {_version_file}"

setup(
    name="fastpipe",
    version=version.group(1),
    description="Pipeline-parallel training for PyTorch: GPipe done right",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="the fastpipe authors",
    license="MIT",
    license_files=["LICENSE"],
    keywords=["pytorch", "pipeline parallelism", "gpipe", "1f1b", "zero bubble", "distributed training", "triton"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    packages=packages,
    package_dir={"fastpipe.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    # py.typed (PEP 561): mypy and IDEs read fastpipe's own type hints, also in fastpipe.kernels.
    package_data={"fastpipe": ["_C.pyi", "py.typed"]},
    entry_points={"console_scripts": ["fastpipe=fastpipe.cli:main"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "tqdm",
        # `fastpipe train` encodes its corpus with numpy, the distributed wire format reads headers
        # through Tensor.numpy(), and the Triton interpreter (TRITON_INTERPRET=1) needs it too.
        "numpy",
        # `fastpipe train` and `fastpipe bench` write PNG charts (loss curve, timeline, results),
        # and the README's first command is `pip install . && fastpipe train`.
        "matplotlib",
    ],
    extras_require={
        "plot": ["matplotlib"],
        # The compiled kernels for CUDA tensors, and the interpreter that runs them on a CPU.
        "triton": triton,
        "hf": hf,
        # The kernel tests also run under TRITON_INTERPRET=1 (see the README), hence triton;
        # tests/hf compares the adapter with the HF models, hence transformers.
        "test": [
            "pytest",
            "pytest-timeout",
            "matplotlib",
            "hypothesis",
            *triton,
            *hf,
        ],
        # scikit-learn: bench/xpipe_convergence.py trains on the digits data set it ships.
        "bench": ["matplotlib", "torchgpipe", "scikit-learn"],
    },
)
