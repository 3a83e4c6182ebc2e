"""Real text every machine has: the source files of Python's own standard library.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` outside
``site-packages`` and the test suites, read in sorted order. Characters map to a fixed
vocabulary (tab, newline, printable ASCII, one slot for anything else), so a checkpoint's
vocabulary never depends on the text. A file goes to validation when the SHA-1 of its path
(relative to the stdlib root) falls in the bottom ``1/val_every`` of the hash range: the split
is fixed, whatever files the Python version ships, and no file is in both halves.

Batches are windows at positions drawn from a generator seeded by ``(seed, step)``, so the
data of step ``n`` depends on nothing but ``n``: a resumed run reads exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["VOCAB", "Corpus", "decode", "encode", "load_corpus", "unigram_entropy"]

# Tab, newline, then printable ASCII; index len(_CHARS) stands for any other character.
_CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(_CHARS) + 1
_UNKNOWN = len(_CHARS)
_TABLE = np.full(256, _UNKNOWN, dtype=np.uint8)
for _i, _c in enumerate(_CHARS):
    _TABLE[ord(_c)] = _i
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def encode(text: str | bytes) -> Tensor:
    """Character ids (int64) of ``text``; non-ASCII bytes map to the unknown id."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return torch.from_numpy(_TABLE[np.frombuffer(data, dtype=np.uint8)].astype(np.int64))


def decode(ids: Tensor | list[int]) -> str:
    """The text of character ids (the unknown id prints as ``?``)."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    return "".join(_CHARS[i] if 0 <= i < len(_CHARS) else "?" for i in values)


def _stdlib_files(root: str) -> list[str]:
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("."))
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    return sorted(files)


def _is_validation(relpath: str, val_every: int) -> bool:
    digest = hashlib.sha1(relpath.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") % val_every == 0


@dataclass
class Corpus:
    """Encoded train and validation text.

    Attributes:
        train, val: 1-D uint8 tensors of character ids.
        root: the stdlib folder read.
        files: (train files, validation files).
    """

    train: Tensor
    val: Tensor
    root: str
    files: tuple[int, int]

    def batch(self, split: str, batch: int, seq_len: int, seed: int, step: int) -> tuple[Tensor, Tensor]:
        """``batch`` windows of ``seq_len`` ids and their next-character targets (int64).

        The positions depend only on ``(split, seed, step)``.
        """
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} text has {len(data)} characters; --seq-len {seq_len} needs more")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        windows = data[idx].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def load_corpus(root: str | None = None, val_every: int = 20, max_chars: int | None = None) -> Corpus:
    """Reads and encodes the standard library's sources (see the module docstring).

    Args:
        root: folder to read instead of the stdlib (tests).
        val_every: about one file in ``val_every`` goes to validation.
        max_chars: stop reading once the train text has this many characters (files stay whole).

    Raises:
        FileNotFoundError: no ``.py`` file under ``root``.
        ValueError: the split left one half empty (too few files).
    """
    root = root or sysconfig.get_paths()["stdlib"]
    files = _stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; pass a folder of Python sources")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    counts = {False: 0, True: 0}
    for path in files:
        is_val = _is_validation(os.path.relpath(path, root), val_every)
        if max_chars is not None and sizes[is_val] >= (max_chars if not is_val else max(max_chars // val_every, 1)):
            continue
        with open(path, "rb") as f:
            data = f.read()
        parts[is_val].append(data)
        sizes[is_val] += len(data)
        counts[is_val] += 1
    if not parts[False] or not parts[True]:
        raise ValueError(f"{root}: {len(files)} files are too few for a train/validation split")
    train = torch.from_numpy(_TABLE[np.frombuffer(b"".join(parts[False]), dtype=np.uint8)])
    val = torch.from_numpy(_TABLE[np.frombuffer(b"".join(parts[True]), dtype=np.uint8)])
    return Corpus(train, val, root, (counts[False], counts[True]))


def unigram_entropy(train: Tensor, val: Tensor) -> float:
    """Cross-entropy in nats of ``val`` under the train text's character frequencies.

    The loss of the best model that ignores context (add-one smoothed): what a language
    model must beat to have learned anything beyond character counts.
    """
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1.0
    logp = (counts / counts.sum()).log()
    val_counts = torch.bincount(val.long(), minlength=VOCAB).double()
    return float(-(val_counts * logp).sum() / val_counts.sum()) if val_counts.sum() > 0 else math.nan
