"""Launch settings: table lookup, fallback, overrides; and that non-default settings compute the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testutils import INTERPRET

from fastpipe.kernels import add_dropout_layer_norm, add_dropout_rms_norm, bias_gelu, configs, swiglu


def test_tuned_table_then_fallback(monkeypatch):
    monkeypatch.setattr(configs, "arch_key", lambda device: "sm90")
    monkeypatch.setattr(
        configs, "TUNED", {"sm90": {"norm_fwd": {4096: dict(num_warps=4)}, "ce": {"*": dict(block_v=8192)}}}
    )
    dev = torch.device("cpu")
    assert configs.launch_config("norm_fwd", dev, 4000) == {**configs.FALLBACK["norm_fwd"], "num_warps": 4}
    assert configs.launch_config("norm_fwd", dev, 1000) == configs.FALLBACK["norm_fwd"]  # other bucket
    assert configs.launch_config("ce", dev, 3)["block_v"] == 8192  # "*": any width
    monkeypatch.setattr(configs, "arch_key", lambda device: "sm80")
    assert configs.launch_config("ce", dev, 3) == configs.FALLBACK["ce"]  # unknown GPU


def test_override_wins_and_is_restored():
    dev = torch.device("cpu")
    before = configs.launch_config("lce", dev)
    with configs.override("lce", dict(strategy="accumulate")):
        assert configs.launch_config("lce", dev)["strategy"] == "accumulate"
        with configs.override("lce", dict(chunk_ratio=2.0)):
            assert configs.launch_config("lce", dev)["chunk_ratio"] == 2.0
        assert configs.launch_config("lce", dev)["strategy"] == "accumulate"
    assert configs.launch_config("lce", dev) == before
    with pytest.raises(KeyError, match="unknown op"), configs.override("nope", {}):
        pass


def test_every_candidate_names_known_keys():
    for op, cands in configs.CANDIDATES.items():
        for cand in cands:
            assert set(cand) <= set(configs.FALLBACK[op]), (op, cand)


@pytest.mark.skipif(not INTERPRET, reason="settings only reach the Triton kernels (TRITON_INTERPRET=1 or CUDA)")
def test_multi_program_settings_compute_the_same():
    """Several programs, several rows per step and partial dW/db/dbias sums: same numbers as
    float64 at an odd shape (129 x 100: ragged last row block and column block)."""
    m, n = 129, 100
    x64, r64, w64, b64 = (torch.randn(*s, dtype=torch.float64) for s in [(m, n), (m, n), (n,), (n,)])
    settings = [
        ("norm_fwd", dict(rows=4, num_warps=1)),
        ("norm_bwd", dict(rows=2, num_warps=1, progs_per_sm=3)),
        ("bias_gelu", dict(block_r=8, block_c=32, num_warps=1, progs_per_sm=5)),
        ("elementwise", dict(block=512, num_warps=1)),
    ]
    with configs.override(*settings[0]), configs.override(*settings[1]), configs.override(*settings[2]):
        with configs.override(*settings[3]):
            for rms in (False, True):
                x, r, w, b = (t.float().requires_grad_() for t in (x64, r64, w64, b64))
                xr, rr, wr, br = (t.clone().requires_grad_() for t in (x64, r64, w64, b64))
                if rms:
                    y = add_dropout_rms_norm(x, r, w)[0]
                    h = xr + rr
                    y_ref = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * wr
                else:
                    y = add_dropout_layer_norm(x, r, w, b)[0]
                    y_ref = F.layer_norm(xr + rr, (n,), wr, br)
                g = torch.randn(m, n, dtype=torch.float64)
                (y * g.float()).sum().backward()
                (y_ref * g).sum().backward()
                torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
                for got, want in [(x, xr), (r, rr), (w, wr)] + ([] if rms else [(b, br)]):
                    torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-4)
            x, b = x64.float().requires_grad_(), b64.float().requires_grad_()
            xr, br = x64.clone().requires_grad_(), b64.clone().requires_grad_()
            g = torch.randn(m, n, dtype=torch.float64)
            (bias_gelu(x, b) * g.float()).sum().backward()
            (F.gelu(xr + br) * g).sum().backward()
            torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.grad.double(), br.grad, rtol=1e-4, atol=1e-4)
            a, c = x64.float(), r64.float()
            torch.testing.assert_close(swiglu(a, c).double(), F.silu(x64) * r64, rtol=1e-5, atol=1e-5)


def test_fp32_residual_stream_stays_fp32():
    """bf16 x with an fp32 residual: new_residual is fp32 (not cut to bf16), out is bf16, and each
    gradient comes back in its input's dtype."""
    x = torch.randn(9, 64).bfloat16().requires_grad_()
    r = torch.randn(9, 64, dtype=torch.float32, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    out, new_res = add_dropout_layer_norm(x, r, w, None)
    assert new_res.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(new_res, x.float() + r, rtol=0, atol=0)
    (out.float().sum() + new_res.sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "op,cfg,n,expected",
    [
        ("norm_fwd", None, 4096, (1, 16)),  # the fallback as it is: 8 elements per thread
        ("norm_fwd", None, 1024, (4, 16)),  # narrow rows: several per block
        ("norm_fwd", None, 8192, (1, 16)),
        ("norm_fwd", None, 16384, (1, 32)),  # 16 warps would hold 32 elements per thread
        ("norm_fwd", None, 32768, None),  # too wide for one block of 32 warps: the PyTorch path
        ("norm_fwd", None, 65536, None),
        ("norm_bwd", None, 4096, (1, 16)),
        ("norm_bwd", None, 16384, (1, 32)),
        ("norm_bwd", None, 20000, None),
        ("norm_fwd", dict(rows=4, num_warps=16), 4096, (4, 32)),  # a tuned 4 rows: more warps
        ("norm_fwd", dict(rows=4, num_warps=16), 8192, (2, 32)),  # ... and cut to what fits
    ],
)
def test_norm_launch_keeps_wide_rows_in_registers(monkeypatch, op, cfg, n, expected):
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's rule
    got = configs.norm_launch(op, cfg or configs.FALLBACK[op], 1000, n)
    assert got == expected


@pytest.mark.parametrize("op", ["norm_fwd", "norm_bwd"])
def test_norm_launch_never_exceeds_the_register_budget(monkeypatch, op):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    for bits in range(0, 17):
        for cfg in [configs.FALLBACK[op], *configs.CANDIDATES[op]]:
            launch = configs.norm_launch(op, cfg, 4096, 1 << bits)
            if launch is None:
                assert 1 << bits > 32 * configs.MAX_NORM_WARPS * configs.NORM_ELEMENTS_PER_THREAD[op]
                continue
            rows, warps = launch
            assert warps <= configs.MAX_NORM_WARPS and warps >= cfg["num_warps"]
            assert rows * (1 << bits) <= warps * 32 * configs.NORM_ELEMENTS_PER_THREAD[op]


def test_norm_launch_under_the_interpreter_takes_the_config(monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: True)
    assert configs.norm_launch("norm_bwd", configs.FALLBACK["norm_bwd"], 1000, 65536) == (1, 16)
    assert configs.norm_launch("norm_fwd", dict(rows=0, num_warps=1), 1000, 64) == (1024, 1)
