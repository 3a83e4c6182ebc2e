"""Benchmark and check fastpipe.kernels.

On a GPU: fwd+bwd time of each fused op vs eager torch and torch.compile, achieved GB/s against
measured copy bandwidth, and peak memory. On CPU (or with TRITON_INTERPRET=1): correctness
against float64 and the saved-activation-bytes table only (CPU times say nothing about GPUs).

Usage::

    python -m fastpipe.bench.kernels [--json out.json] [--rows N] [--hidden H]
    fastpipe bench --only kernels     # the same, as one part of the suite
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fastpipe.kernels as fk
from fastpipe.bench.report import write_json
from fastpipe.kernels.memory import count_saved_bytes

__all__ = ["main", "run_kernels"]


# --------------------------------------------------------------------------- eager references
class EagerMLPBlock(nn.Module):
    """x + drop(fc2(gelu(fc1(norm(x))))) in plain torch; same state_dict as fk.MLPBlock."""

    def __init__(self, hidden: int, ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm, self.fc1 = nn.LayerNorm(hidden), nn.Linear(hidden, ffn)
        self.act, self.fc2, self.drop = nn.GELU(), nn.Linear(ffn, hidden), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def make_cases(rows: int, hidden: int, vocab: int, device: str, dtype: torch.dtype) -> list[dict]:
    """Each case: name, inputs (leaves), fused fn, eager fn, and minimal bytes moved by fwd+bwd.

    Minimal traffic counts each row-sized tensor read or written once per pass, e.g. LayerNorm
    fwd reads x and writes y, bwd reads dy and x and writes dx: 5 tensors (small vectors ignored).
    """
    t = lambda *s, scale=1.0: (torch.randn(*s, device=device, dtype=dtype) * scale).requires_grad_()
    e = torch.tensor([], dtype=dtype).element_size()
    rh = rows * hidden
    tgt = torch.randint(0, vocab, (rows,), device=device)
    mlp_eager = EagerMLPBlock(hidden, 4 * hidden).to(device, dtype)
    mlp_fused = fk.MLPBlock(hidden, 4 * hidden).to(device, dtype)
    mlp_fused.load_state_dict(mlp_eager.state_dict())
    cases = [
        dict(name="layer_norm", inputs=[t(rows, hidden), t(hidden), t(hidden)],
             fused=lambda x, w, b: fk.add_dropout_layer_norm(x, None, w, b)[0],
             eager=lambda x, w, b: F.layer_norm(x, (hidden,), w, b), bytes=5 * rh * e),
        dict(name="add_layer_norm", inputs=[t(rows, hidden), t(rows, hidden), t(hidden), t(hidden)],
             fused=lambda x, r, w, b: fk.add_dropout_layer_norm(x, r, w, b)[0],
             eager=lambda x, r, w, b: F.layer_norm(x + r, (hidden,), w, b), bytes=8 * rh * e),
        dict(name="rms_norm", inputs=[t(rows, hidden), t(hidden)],
             fused=lambda x, w: fk.add_dropout_rms_norm(x, None, w)[0], eager=_rms, bytes=5 * rh * e),
        dict(name="bias_gelu", inputs=[t(rows, 4 * hidden), t(4 * hidden)],
             fused=lambda x, b: fk.bias_gelu(x, b), eager=lambda x, b: F.gelu(x + b), bytes=20 * rh * e),
        dict(name="swiglu", inputs=[t(rows, 4 * hidden), t(rows, 4 * hidden)],
             fused=fk.swiglu, eager=lambda a, b: F.silu(a) * b, bytes=32 * rh * e),
        dict(name="dropout", inputs=[t(rows, hidden)],
             fused=lambda x: fk.dropout(x, 0.1, seed=1), eager=lambda x: F.dropout(x, 0.1), bytes=4 * rh * e),
        dict(name="mlp_block", inputs=[t(rows, hidden)], fused=mlp_fused, eager=mlp_eager, bytes=0),
        dict(name="linear_cross_entropy", inputs=[t(rows, hidden), t(vocab, hidden, scale=0.02)],
             fused=lambda x, w: fk.linear_cross_entropy(x, w, tgt),
             eager=lambda x, w: F.cross_entropy((x @ w.t()).float(), tgt), bytes=0),
    ]  # fmt: skip
    return cases


# --------------------------------------------------------------------------- saved bytes
def saved_bytes(fn: Callable[[], object], params: Iterable[torch.Tensor]) -> int:
    return count_saved_bytes(fn, params)[0]


def saved_bytes_table(device: str) -> list[dict]:
    rows, hidden, ffn = 8, 512, 2048
    out = []
    x = torch.randn(rows, hidden, device=device, requires_grad=True)
    for p in (0.0, 0.1):
        eager, fused = EagerMLPBlock(hidden, ffn, p).to(device), fk.MLPBlock(hidden, ffn, p).to(device)
        fused.load_state_dict(eager.state_dict())
        e_bytes = saved_bytes(functools.partial(eager, x), eager.parameters())
        f_bytes = saved_bytes(functools.partial(fused, x), fused.parameters())
        out.append((f"MLP block 512/2048 (p={p})", e_bytes, f_bytes))
    r = torch.randn(rows, hidden, device=device, requires_grad=True)
    w, b = torch.ones(hidden, device=device), torch.zeros(hidden, device=device)
    e_bytes = saved_bytes(lambda: F.layer_norm(r + F.dropout(x, 0.1), (hidden,), w, b), [w, b])
    f_bytes = saved_bytes(lambda: fk.add_dropout_layer_norm(x, r, w, b, p=0.1)[0], [w, b])
    out.append(("residual+dropout+layer_norm", e_bytes, f_bytes))
    h = torch.randn(rows, ffn, device=device, requires_grad=True)
    h2 = torch.randn(rows, ffn, device=device, requires_grad=True)
    bb = torch.zeros(ffn, device=device, requires_grad=True)
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "bias+gelu": (lambda: F.gelu(h + bb), lambda: fk.bias_gelu(h, bb)),
        "swiglu": (lambda: F.silu(h) * h2, lambda: fk.swiglu(h, h2)),
        "dropout": (lambda: F.dropout(h, 0.1), lambda: fk.dropout(h, 0.1)),
    }
    for name, (eager_fn, fused_fn) in pairs.items():
        out.append((name, saved_bytes(eager_fn, [bb]), saved_bytes(fused_fn, [bb])))
    return [
        dict(
            op=n, rows=rows, eager_floats_per_row=e / 4 / rows, fused_floats_per_row=f / 4 / rows, ratio=f / e
        )  # fmt: skip
        for n, e, f in out
    ]


# --------------------------------------------------------------------------- correctness
def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [i.detach().clone().requires_grad_() for i in inputs]
    y = fn(*leaves)
    gen = torch.Generator().manual_seed(0)
    g = torch.ones_like(y) if y.dim() == 0 else torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    (y * g).sum().backward()
    return y.detach(), [leaf.grad for leaf in leaves if leaf.grad is not None]


def correctness(cases: list[dict]) -> list[dict]:
    out = []
    for c in cases:
        if c["name"] in ("dropout", "mlp_block"):  # random mask / module parameters: covered by tests
            continue
        y, gs = _grads(c["fused"], [i.float() for i in c["inputs"]])
        y64, gs64 = _grads(c["eager"], [i.double() for i in c["inputs"]])
        errs = [(y.double() - y64).abs().max().item()]
        errs += [(a.double() - b).abs().max().item() for a, b in zip(gs, gs64, strict=True)]
        err = max(errs)
        out.append(dict(op=c["name"], max_abs_err_fp32_vs_fp64=err))
    return out


# --------------------------------------------------------------------------- GPU timing
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], None], iters: int = 20) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on a GPU, perf_counter otherwise)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    n = 1 << 28 if torch.cuda.is_available() else 1 << 24
    src = torch.empty(n, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: None if dst.copy_(src) is None else None)
    return 2 * src.numel() / ms / 1e6


def timings(cases: list[dict], copy_gbs: float, use_compile: bool = True) -> list[dict]:
    """fwd+bwd time, peak memory (CUDA only) and achieved bandwidth of fused vs eager vs compile."""
    cuda = torch.cuda.is_available()
    out = []
    for c in cases:
        ins = c["inputs"]
        row: dict = dict(op=c["name"])
        variants = {"fused": c["fused"], "eager": c["eager"]}
        if use_compile:
            variants["compile"] = torch.compile(c["eager"])
        with torch.no_grad():
            y0 = c["eager"](*ins)
        grad = None if y0.dim() == 0 else torch.randn_like(y0)
        for label, fn in variants.items():

            def step(fn: Callable = fn, ins: list = ins, grad: torch.Tensor | None = grad) -> None:
                torch.autograd.backward(fn(*ins), grad)

            try:
                _sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if cuda else 0
                row[f"{label}_ms"] = _time_ms(step)
                if cuda:
                    row[f"{label}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            except Exception as exc:  # keep going: one failing variant should not hide the rest
                row[f"{label}_error"] = repr(exc)[:200]
            for i in ins:
                i.grad = None
        if "fused_ms" in row and "eager_ms" in row:
            row["speedup_vs_eager"] = row["eager_ms"] / row["fused_ms"]
        if "fused_ms" in row and "compile_ms" in row:
            row["speedup_vs_compile"] = row["compile_ms"] / row["fused_ms"]
        if c["bytes"] and "fused_ms" in row:
            row["fused_gbs"] = c["bytes"] / row["fused_ms"] / 1e6
            row["pct_of_copy_bw"] = 100 * row["fused_gbs"] / copy_gbs
        out.append(row)
    return out


def _print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).ljust(w) for k, w in zip(keys, widths, strict=True)))


def run_kernels(
    rows: int | None = None, hidden: int | None = None, use_compile: bool = True, cpu_timings: bool = False
) -> dict[str, Any]:
    """Measures every fused op and returns the results; prints nothing (see :func:`main` for the tables).

    Args:
        rows: rows of the timed inputs (default 16384 on a GPU, 64 on CPU).
        hidden: their width (default 4096 on a GPU, 256 on CPU).
        use_compile: also time ``torch.compile`` of the eager reference.
        cpu_timings: time on CPU too (a smoke test of the GPU code path; the figures mean nothing).

    Returns:
        ``device``, ``torch``, ``triton_interpret``, ``path``, ``correctness`` and ``saved_bytes``; with timings
        also ``copy_gbs``, ``shape`` and ``timings``.
    """
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    path = "triton" if (cuda or interp) and fk.HAS_TRITON else "reference"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    result: dict[str, Any] = dict(device=device_name, torch=torch.__version__, triton_interpret=interp, path=path)
    torch.manual_seed(0)
    small = make_cases(7, 1000, 1000 if interp else 4099, device, torch.float32)
    result["correctness"] = correctness(small)
    result["saved_bytes"] = saved_bytes_table(device)
    if cuda or cpu_timings:
        rows, hidden = rows or (16384 if cuda else 64), hidden or (4096 if cuda else 256)
        dtype = torch.bfloat16 if cuda else torch.float32
        result["copy_gbs"] = copy_bandwidth_gbs()
        result["shape"] = dict(rows=rows, hidden=hidden, vocab=32000, dtype=str(dtype))
        cases = make_cases(rows, hidden, 32000, device, dtype)
        result["timings"] = timings(cases, result["copy_gbs"], use_compile=use_compile)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m fastpipe.bench.kernels``: measures, prints the tables and a ``JSON`` line, returns the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--rows", type=int, default=None, help="rows of the timed inputs (default: 16384 GPU, 64 CPU)")
    ap.add_argument("--hidden", type=int, default=None, help="width of the timed inputs (default: 4096 GPU, 256 CPU)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--cpu-timings", action="store_true", help="time on CPU too (smoke test of the GPU code path)")
    args = ap.parse_args(argv)
    result = run_kernels(args.rows, args.hidden, use_compile=not args.no_compile, cpu_timings=args.cpu_timings)
    _print_table(f"correctness: fp32 kernels vs float64 torch ({result['path']} path)", result["correctness"])
    _print_table("saved activation bytes (fp32, parameters excluded)", result["saved_bytes"])
    if "timings" in result:
        shape = result["shape"]
        print(f"\ncopy bandwidth: {result['copy_gbs']:.0f} GB/s")
        _print_table(f"fwd+bwd, {shape['dtype']}, rows={shape['rows']} hidden={shape['hidden']}", result["timings"])
    else:
        print("\n(no CUDA device: timings skipped; CPU times would not predict GPU behaviour)")
    write_json(result, args.json)
    # One line for bench/gpu_check.sh's summary table: speed-up over eager and % of copy bandwidth per op.
    brief: dict[str, Any] = {
        r.get("op", "?"): [round(r.get("speedup_vs_eager", 0.0), 2), round(r.get("pct_of_copy_bw", 0.0))]
        for r in result.get("timings", [])
    }
    print("JSON " + json.dumps(brief or {"timings": "skipped (no CUDA)"}))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
