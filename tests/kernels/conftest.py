"""Fixtures for the kernel tests.

Every test here runs twice in CI: plainly (PyTorch reference path) and with
``TRITON_INTERPRET=1`` (the real Triton kernels on CPU). Helpers live in ``kernel_testutils``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from kernel_testutils import count_saved_bytes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests under this directory without CUDA (even if run on their own)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if item.get_closest_marker("gpu") is not None and str(item.path).startswith(here):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def saved_bytes() -> Callable[..., tuple[int, torch.Tensor]]:
    return count_saved_bytes
