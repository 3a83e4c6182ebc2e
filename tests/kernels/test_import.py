"""fastpipe.kernels stands alone: no engine imports, and it works without triton."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import fastpipe.kernels

KERNELS_DIR = pathlib.Path(fastpipe.kernels.__file__).parent


def test_imports_nothing_from_the_engine():
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("fastpipe"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("fastpipe") for a in node.names), path


def test_works_without_triton(tmp_path):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, fastpipe.kernels as fk\n"
        "assert not fk.HAS_TRITON\n"
        "x = torch.randn(3, 8, requires_grad=True)\n"
        "out, _ = fk.add_dropout_layer_norm(x, None, None, None, p=0.5)\n"
        "(out.sum() + fk.bias_gelu(x).sum() + fk.dropout(x, 0.5).sum()).backward()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    # Run outside the checkout so the installed package is imported, not the source tree.
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_dispatch_rule(monkeypatch):
    from fastpipe.kernels._common import HAS_TRITON, use_triton

    x = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(x) == HAS_TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_triton(x)


def test_a_tensor_beyond_int32_indexing_takes_the_pytorch_path(monkeypatch):
    from fastpipe.kernels import _common

    monkeypatch.setattr(_common, "HAS_TRITON", True)
    monkeypatch.setattr(_common, "interpreting", lambda: True)  # as if the kernels would run here
    monkeypatch.setattr(_common, "_LARGE_WARNED", False)
    huge = torch.empty(2**31, dtype=torch.bool, device="meta")  # no memory behind it
    with pytest.warns(UserWarning, match="runs on the PyTorch path"):
        assert _common.use_triton(huge) is False
    assert _common.use_triton(torch.empty(8, device="meta")) is True
