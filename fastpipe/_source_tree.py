"""Importing fastpipe straight from its source tree (a clone, with no build step).

``setup.py`` installs the top-level ``kernels/`` folder as the subpackage ``fastpipe.kernels``
(``package_dir``) and builds ``fastpipe._C`` into the installed package. A source tree has
neither in ``fastpipe/``, and it is what Python imports whenever the clone's root comes first
on ``sys.path`` (``python -m fastpipe.demo`` or a script run from the root)::

    <root>/setup.py
    <root>/kernels/__init__.py     -> fastpipe.kernels   (only this finder maps it)
    <root>/fastpipe/__init__.py    -> fastpipe
    <root>/fastpipe/_C*.so         -> fastpipe._C        (built in place by ``pip install -e .``;
                                                           ``pip install .`` builds it elsewhere)

:func:`install` puts :class:`SourceTreeFinder` first on ``sys.meta_path`` only for such a
tree (``setup.py`` and ``kernels/__init__.py`` beside ``fastpipe/``, no ``fastpipe/kernels``),
so an installed package is never touched. The finder answers two names and no others:

- ``fastpipe.kernels`` is ``<root>/kernels/``. Its submodules (``fastpipe.kernels.layer_norm``)
  are then found the ordinary way, through the package's ``__path__``.
- ``fastpipe._C``, when the tree has none, is the extension of an installed fastpipe of the
  same version (``pip install .`` from this clone), else an ``ImportError`` that says how to
  build it. Being first on ``sys.meta_path``, the finder also keeps an editable install of
  some *other* checkout from lending this tree its extension.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["SourceTreeFinder", "install"]

_KERNELS = "fastpipe.kernels"
_EXTENSION = "fastpipe._C"
# The file names of fastpipe/_C that this interpreter can load (_C.cpython-311-x86_64-linux-gnu.so, _C.abi3.so, ...).
_EXTENSION_FILES = frozenset(f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES)


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``fastpipe.kernels`` and, if need be, ``fastpipe._C`` for the source tree at ``root``.

    Args:
        root: the folder that holds ``setup.py``, ``fastpipe/`` and ``kernels/``.
        version: this tree's ``fastpipe.__version__``; an installed extension must match it.
    """

    def __init__(self, root: Path, version: str) -> None:
        self.root = root
        self.version = version

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``fastpipe.kernels`` or ``fastpipe._C``; None for any other name.

        Raises:
            ModuleNotFoundError: ``fastpipe._C`` is built neither here nor in an installed fastpipe.
        """
        if fullname == _KERNELS:
            kernels = self.root / "kernels"
            return importlib.util.spec_from_file_location(
                fullname, kernels / "__init__.py", submodule_search_locations=[str(kernels)]
            )
        if fullname == _EXTENSION and not _built_in(self.root / "fastpipe"):
            installed = self._installed_extension()
            if installed is None:
                raise ModuleNotFoundError(
                    f"fastpipe._C, fastpipe's compiled extension, is not built in the source tree {self.root} "
                    f"and no installed fastpipe {self.version} provides it. Run `pip install .` in {self.root} "
                    "(or `pip install -e .` to build it in place).",
                    name=fullname,
                )
            return importlib.util.spec_from_file_location(fullname, installed)
        return None

    def _installed_extension(self) -> Path | None:
        """``fastpipe/_C*.so`` of an installed (non-editable) fastpipe of this tree's version."""
        for dist in importlib.metadata.distributions(name="fastpipe"):
            if dist.version != self.version:
                continue
            for file in dist.files or ():
                # An egg-info in the tree lists sources; an editable install lists no extension.
                if file.parts[:-1] == ("fastpipe",) and file.name in _EXTENSION_FILES:
                    located = Path(str(dist.locate_file(file)))
                    if located.is_file() and located.parent != self.root / "fastpipe":
                        return located
        return None


def _built_in(package: Path) -> bool:
    """Whether ``package`` holds a compiled ``_C`` for this interpreter."""
    return any((package / name).is_file() for name in _EXTENSION_FILES)


def install(package_dir: Path, version: str) -> bool:
    """Put a :class:`SourceTreeFinder` first on ``sys.meta_path`` if ``package_dir`` is in a source tree.

    Args:
        package_dir: the folder of ``fastpipe/__init__.py``.
        version: ``fastpipe.__version__``.

    Returns:
        Whether the finder is installed (False for an installed package, which has ``fastpipe/kernels``).
    """
    root = package_dir.parent
    source_tree = (
        not (package_dir / "kernels").exists()
        and (root / "kernels" / "__init__.py").is_file()
        and (root / "setup.py").is_file()
    )
    if not source_tree:
        return False
    if not any(isinstance(f, SourceTreeFinder) and f.root == root for f in sys.meta_path):
        sys.meta_path.insert(0, SourceTreeFinder(root, version))
    return True
