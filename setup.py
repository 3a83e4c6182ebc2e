"""Build script for fastpipe.

The package is pure Python except for ``fastpipe._C`` (csrc/), a small pybind11
extension that links no torch, no cudart and no CUDA toolkit: the CUDA driver is
loaded at run time. That keeps ``pip install .`` fast and lets one build serve CPU-only
and CUDA hosts.
"""

import re
import tempfile
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup
from setuptools.errors import CCompilerError, PlatformError

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

# Compiles only if the compiler takes C++17 with the extension's own flags.
_CXX17_PROBE = """
#include <optional>
#include <utility>
int probe() {
    std::optional<int> x{1};
    auto [a, b] = std::pair<int, int>{*x, 2};
    if constexpr (sizeof(int) > 0) return a - b;
    return 0;
}
"""


class BuildExtension(build_ext):
    """``build_ext`` that turns "no working C++17 compiler" into one line that says what to install.

    Without it, a host with no compiler (or one too old) sees the compiler's raw failure on
    ``csrc/*.cpp`` inside pip's ``subprocess-exited-with-error`` box. fastpipe has no pure-Python
    fallback for ``fastpipe._C`` (the runtimes' streams, events and host buffer pool live there),
    so the build stops; it does not install half a package.
    """

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except CCompilerError:
            if self._compiles_cxx17():
                raise  # the compiler works, so the fault is in csrc/ and the compiler's own output says where
            compiler = getattr(self.compiler, "compiler_so_cxx", None) or self.compiler.compiler_so
            raise PlatformError(
                f"fastpipe needs a C++17 compiler (g++ >= 7 or clang >= 5) to build fastpipe._C, and "
                f"{compiler[0]!r} compiled no C++17: install one (Debian/Ubuntu: apt-get install build-essential; "
                "Fedora/RHEL: dnf install gcc-c++; macOS: xcode-select --install), or point CC and CXX at one, "
                "and retry"
            ) from None

    def _compiles_cxx17(self) -> bool:
        flags = next(ext.extra_compile_args for ext in self.extensions if ext.name == "fastpipe._C")
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "cxx17_probe.cpp"
            source.write_text(_CXX17_PROBE)
            try:
                self.compiler.compile([str(source)], output_dir=tmp, extra_postargs=flags)
            except CCompilerError:
                return False
        return True


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
# The range is what the test suite has passed on: 5.17 with torch 2.11 (the GPU host's; bench/RESULTS.md,
# "CPU suite on torch 2.11 / transformers 5.17", 2026-12-02) and 5.24 with torch 2.13 (CI's).
hf = ["transformers>=5.17,<6"]

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
    # No url or project_urls: fastpipe has no public home to point at, and the name on the public
    # package index belongs to another project. Add Source and Documentation here once one exists.
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
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    packages=packages,
    package_dir={"fastpipe.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension},
    # py.typed (PEP 561): mypy and IDEs read fastpipe's own type hints, also in fastpipe.kernels.
    package_data={"fastpipe": ["_C.pyi", "py.typed"]},
    entry_points={"console_scripts": ["fastpipe=fastpipe.cli:main"]},
    python_requires=">=3.10",
    install_requires=[
        # 2.11 is what the GPU check host runs, 2.13 what CI runs; older releases are not tried.
        "torch>=2.11",
        "tqdm",
        # `fastpipe train` encodes its corpus with numpy, the distributed wire format reads headers
        # through Tensor.numpy(), and the Triton interpreter (TRITON_INTERPRET=1) needs it too.
        "numpy",
        # `fastpipe train` and `fastpipe bench` write PNG charts (loss curve, timeline, results),
        # and the README's first command is `pip install . && fastpipe train`. Being required, it
        # appears in no extra.
        "matplotlib",
    ],
    extras_require={
        # The compiled kernels for CUDA tensors, and the interpreter that runs them on a CPU.
        "triton": triton,
        "hf": hf,
        # The kernel tests also run under TRITON_INTERPRET=1 (see the README), hence triton;
        # tests/hf compares the adapter with the HF models, hence transformers; tests/package
        # builds this setup.py without build isolation, hence pybind11 and a setuptools with
        # bdist_wheel (Python 3.12 venvs come without setuptools).
        "test": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "pybind11>=2.11",
            "setuptools>=70.1",
            *triton,
            *hf,
        ],
        # scikit-learn: bench/xpipe_convergence.py trains on the digits data set it ships.
        "bench": ["torchgpipe", "scikit-learn"],
    },
)
