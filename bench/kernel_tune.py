"""Tunes fastpipe.kernels' launch configs on a GPU, and compares the kernels with eager and Liger-Kernel.

This script does what the measuring entry point does not: a sweep of ``configs.CANDIDATES`` whose winners
are printed as a ``TUNED`` literal for ``kernels/configs.py``, at the large shapes where tuning matters,
with Liger-Kernel as a third column. To measure the kernels (correctness against float64, saved bytes,
fwd+bwd times against eager and torch.compile), run ``fastpipe bench --only kernels`` or
``python -m fastpipe.bench.kernels``.

For each op, at 16384x4096 and 4096x4096 (4x smaller), bf16 and fp32: fwd+bwd median ms (CUDA
events, 3 warm-ups, 15 timed), peak MiB above the inputs (gradients included), achieved TB/s over
the op's minimal bytes beside the copy bandwidth measured in the same run, and the ratio to eager.
Then linear_cross_entropy (T=8192, H=4096, V=128256, bf16; both strategies), the MLP block and a
transformer block with recompute, and the tuning sweep.

Every section checks a global deadline (``--budget`` seconds, default 230) and is skipped, with a
note, once it has run out. The last line printed is ``JSON {...}`` (a summary); ``--json`` writes
everything.

    python bench/kernel_tune.py [--json out.json] [--budget 230] [--no-tune] [--smoke]

``--smoke`` runs tiny shapes on CPU (with ``TRITON_INTERPRET=1``: the Triton kernels) to check the
script itself; its times mean nothing.

On the GPU host (offline) the Liger-Kernel column needs its wheel carried in ``.whl/`` (git-ignored).
Fetch it here first (it needs only torch and triton, both on the host)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5

then one device ``run`` with ``carry: [".whl"]`` and ``timeout_s: 420``::

    export PYTHONUNBUFFERED=1; set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1;
    python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || exit 1;
    timeout 120 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -25;
    timeout 240 python3 bench/kernel_tune.py --budget 200 --json $OUT/kernel_tune.json 2>&1 | tee $OUT/kernel_tune.log
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastpipe.kernels as fk
from fastpipe.kernels import configs
from fastpipe.kernels.memory import count_saved_bytes

__all__ = ["main"]

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.end - time.monotonic()

    def ok(self, what: str, need: float = 5.0) -> bool:
        if self.left() >= need:
            return True
        self.skipped.append(what)
        print(f"[deadline] skipped: {what}", flush=True)
        return False


# ----------------------------------------------------------------------------------- measuring
def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], warmup: int = 3, iters: int = 15) -> float:
    """Median of ``iters`` timings after ``warmup`` calls (CUDA events; perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(iters):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def peak_mib(fn: Callable[[], Any], leaves: list[torch.Tensor]) -> float:
    """Peak allocated MiB above what exists before ``fn`` (inputs, incoming grad); grads count."""
    if not CUDA:
        return float("nan")
    for t in leaves:
        t.grad = None
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    _sync()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    for t in leaves:
        t.grad = None
    return peak


def copy_tbs() -> float:
    """Device-to-device copy, bytes read + written per second, in TB/s (the roofline here)."""
    n = (1 << 30) if CUDA else (1 << 22)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * n / ms / 1e9


def fwd_bwd(fn: Callable[..., torch.Tensor], ins: list[torch.Tensor]) -> Callable[[], None]:
    y0 = fn(*ins)
    grad = None if y0.dim() == 0 else torch.randn_like(y0)
    del y0

    def step() -> None:
        for t in ins:
            t.grad = None
        torch.autograd.backward(fn(*ins), grad)

    return step


# ----------------------------------------------------------------------------------- the ops
def _liger() -> dict[str, Callable[..., torch.Tensor]]:
    """Liger-Kernel 0.8.5's ops called directly, where importable (else an empty dict)."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as AddRms
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as Flce
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction as Ln
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as Rms
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Swiglu
    except Exception as exc:  # optional column
        print(f"(Liger-Kernel not importable: {exc!r}; its column stays empty)")
        return {}

    def first(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, tuple) else out

    return {
        "layer_norm": lambda x, w, b: Ln.apply(x, w, b, 1e-5),
        "rms_norm": lambda x, w: Rms.apply(x, w, 1e-6, 0.0, "llama", False),
        "add_rms_norm": lambda x, r, w: first(AddRms.apply(x, r, w, 1e-6)),
        "swiglu": lambda a, b: Swiglu.apply(a, b),
        "linear_cross_entropy": lambda x, w, t: first(Flce.apply(x, w, t)),
    }


def op_cases(rows: int, hidden: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """name, inputs, eager, fastpipe, minimal fwd+bwd bytes (each row-sized tensor once per pass)."""
    n = rows * hidden
    e = torch.empty((), dtype=dtype).element_size()

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_()

    x, r, w, b = t(rows, hidden), t(rows, hidden), t(hidden), t(hidden)
    h = hidden
    return [
        dict(name="layer_norm", ins=[x, w, b], bytes=5 * n * e,
             eager=lambda x, w, b: F.layer_norm(x, (h,), w, b),
             fast=lambda x, w, b: fk.add_dropout_layer_norm(x, None, w, b)[0]),
        dict(name="add_dropout_layer_norm", ins=[x, r, w, b], bytes=8 * n * e,
             eager=lambda x, r, w, b: F.layer_norm(r + F.dropout(x, 0.1), (h,), w, b),
             fast=lambda x, r, w, b: fk.add_dropout_layer_norm(x, r, w, b, p=0.1)[0]),
        dict(name="add_rms_norm", ins=[x, r, w], bytes=8 * n * e,
             eager=lambda x, r, w: F.rms_norm(x + r, (h,), w, 1e-6),
             fast=lambda x, r, w: fk.add_dropout_rms_norm(x, r, w)[0]),
        dict(name="rms_norm", ins=[x, w], bytes=5 * n * e,
             eager=lambda x, w: F.rms_norm(x, (h,), w, 1e-6),
             fast=lambda x, w: fk.add_dropout_rms_norm(x, None, w)[0]),
        dict(name="swiglu", ins=[x, r], bytes=8 * n * e,
             eager=lambda a, b: F.silu(a) * b, fast=fk.swiglu),
        dict(name="bias_gelu", ins=[x, b], bytes=5 * n * e,
             eager=lambda x, b: F.gelu(x + b), fast=fk.bias_gelu),
        dict(name="dropout", ins=[x], bytes=4 * n * e,
             eager=lambda x: F.dropout(x, 0.1), fast=lambda x: fk.dropout(x, 0.1)),
    ]  # fmt: skip


def measure(case: dict[str, Any], variants: dict[str, Callable[..., torch.Tensor]], bw: float) -> dict[str, Any]:
    row: dict[str, Any] = dict(op=case["name"])
    for label, fn in variants.items():
        try:
            step = fwd_bwd(fn, case["ins"])
            row[f"{label}_ms"] = round(time_ms(step), 4)
            row[f"{label}_mib"] = round(peak_mib(step, case["ins"]), 1)
        except Exception as exc:  # one failing variant must not hide the others
            row[f"{label}_error"] = repr(exc)[:160]
    if "fast_ms" in row:
        if "eager_ms" in row:
            row["x_eager"] = round(row["eager_ms"] / row["fast_ms"], 3)
        if "liger_ms" in row:
            row["x_liger"] = round(row["liger_ms"] / row["fast_ms"], 3)
        if case.get("bytes"):
            tbs = case["bytes"] / row["fast_ms"] / 1e9
            row["fast_TBs"] = round(tbs, 3)
            row["pct_copy_bw"] = round(100 * tbs / bw, 1)
            row["floor_ms"] = round(case["bytes"] / bw / 1e9, 4)
    return row


# ----------------------------------------------------------------------------------- blocks
class EagerBlock(nn.Module):
    """Pre-norm transformer block in plain torch (attention through SDPA)."""

    def __init__(self, hidden: int, heads: int, ffn: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.qkv, self.proj = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def attn(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.proj(self.attn(self.qkv(self.ln1(x)))), self.p, self.training)
        return h + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(h)))), self.p, self.training)


class FusedBlock(EagerBlock):
    """The same block (same state_dict) from fastpipe's ops: norm+Linear pairs that recompute the
    norm, residual+dropout+LayerNorm in one kernel, bias-GELU+Linear that recomputes the GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(fk.layer_norm_linear(x, self.ln1.weight, self.ln1.bias, self.qkv.weight, self.qkv.bias))
        y, h = fk.add_dropout_layer_norm(self.proj(a), x, self.ln2.weight, self.ln2.bias, p=self.p,
                                         training=self.training)  # fmt: skip
        g = fk.bias_gelu_linear(F.linear(y, self.fc1.weight, self.fc1.bias), None, self.fc2.weight, self.fc2.bias)
        return h + fk.dropout(g, self.p, self.training)


def block_rows(dtype: torch.dtype, smoke: bool) -> list[dict[str, Any]]:
    """fwd+bwd ms of eager, eager under torch.utils.checkpoint, and fastpipe's blocks; saved
    bytes per token (fastpipe / eager, parameters excluded)."""
    b, s, h, heads = (2, 8, 64, 2) if smoke else (4, 2048, 4096, 32)
    from kernel_testutils import EagerMLPBlock  # tests/kernels: the plain block MLPBlock replaces

    out = []
    for name in ("mlp_block", "transformer_block"):
        eager: nn.Module
        fast: nn.Module
        if name == "mlp_block":
            eager = EagerMLPBlock(h, 4 * h, 0.1).to(DEV, dtype)
            fast = fk.MLPBlock(h, 4 * h, 0.1).to(DEV, dtype)
        else:
            eager = EagerBlock(h, heads, 4 * h, 0.1).to(DEV, dtype)
            fast = FusedBlock(h, heads, 4 * h, 0.1).to(DEV, dtype)
        fast.load_state_dict(eager.state_dict())
        x = torch.randn(b, s, h, device=DEV, dtype=dtype, requires_grad=True)
        row: dict[str, Any] = dict(op=name, dtype=str(dtype).replace("torch.", ""), tokens=b * s, hidden=h)
        variants = {
            "eager": lambda x, m=eager: m(x),
            "eager_ckpt": lambda x, m=eager: checkpoint(m, x, use_reentrant=False),
            "fast": lambda x, m=fast: m(x),
        }
        for label, fn in variants.items():
            try:
                step = fwd_bwd(fn, [x])
                row[f"{label}_ms"] = round(time_ms(step, iters=10), 3)
                row[f"{label}_mib"] = round(peak_mib(step, [x]), 1)
            except Exception as exc:
                row[f"{label}_error"] = repr(exc)[:160]
        e_bytes = count_saved_bytes(lambda m=eager, x=x: m(x), eager.parameters())[0]
        f_bytes = count_saved_bytes(lambda m=fast, x=x: m(x), fast.parameters())[0]
        row["saved_ratio"] = round(f_bytes / e_bytes, 4)
        if "fast_ms" in row and "eager_ckpt_ms" in row:
            row["x_eager_ckpt"] = round(row["eager_ckpt_ms"] / row["fast_ms"], 3)
        out.append(row)
    return out


# ----------------------------------------------------------------------------------- LCE
def lce_rows(smoke: bool, liger: dict[str, Callable[..., torch.Tensor]], deadline: Deadline) -> list[dict[str, Any]]:
    t, h, v = (64, 32, 1000) if smoke else (8192, 4096, 128256)
    dtype = torch.bfloat16
    x = torch.randn(t, h, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, h, device=DEV, dtype=dtype) * 0.02).requires_grad_()
    tgt = torch.randint(0, v, (t,), device=DEV)
    tgt[::13] = -100
    case = dict(name="linear_cross_entropy", ins=[x, w])
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "eager": lambda x, w: F.cross_entropy((x @ w.t()).float(), tgt),
    }
    if "linear_cross_entropy" in liger:
        variants["liger"] = lambda x, w: liger["linear_cross_entropy"](x, w, tgt)
    rows = []
    for cand in configs.CANDIDATES["lce"]:
        if not deadline.ok(f"lce {cand}", 20):
            break
        with configs.override("lce", cand):
            row = measure(case, {**variants, "fast": lambda x, w: fk.linear_cross_entropy(x, w, tgt)}, 1.0)
        row.update(cand, shape=f"T={t} H={h} V={v}", flops_tf=round(3 * 2 * t * h * v / 1e12, 2))
        for k in ("fast_TBs", "pct_copy_bw", "floor_ms"):  # GEMM-bound: the byte floor means nothing
            row.pop(k, None)
        if rows and "fast_ms" in row:  # eager and Liger ran once, with the first candidate
            for ref in ("eager", "liger"):
                if f"{ref}_ms" in rows[0]:
                    row[f"x_{ref}"] = round(rows[0][f"{ref}_ms"] / row["fast_ms"], 3)
        rows.append(row)
        variants = {}
    return rows


# ----------------------------------------------------------------------------------- tuning
def tune(cases: list[dict[str, Any]], deadline: Deadline) -> dict[str, Any]:
    """Sweep each op's candidates on the big bf16 shape; keep the fastest (fwd+bwd)."""
    by_name = {c["name"]: c for c in cases}
    plan = [
        ("norm_fwd", ["layer_norm", "add_dropout_layer_norm", "rms_norm"]),
        ("norm_bwd", ["layer_norm", "add_dropout_layer_norm", "rms_norm"]),
        ("elementwise", ["swiglu", "dropout"]),
        ("bias_gelu", ["bias_gelu"]),
    ]
    winners: dict[str, Any] = {}
    for op, names in plan:
        results = []
        for cand in configs.CANDIDATES[op]:
            if not deadline.ok(f"tune {op} {cand}", 10):
                break
            with configs.override(op, {**winners.get(op, {}), **cand}):
                try:
                    ms = sum(time_ms(fwd_bwd(by_name[n]["fast"], by_name[n]["ins"]), iters=10) for n in names)
                except Exception as exc:
                    print(f"tune {op} {cand}: {exc!r}"[:200])
                    continue
            results.append((ms, cand))
            print(f"tune {op:12s} {cand}: {ms:.4f} ms over {names}", flush=True)
        if results:
            winners[op] = min(results, key=lambda r: r[0])[1]
        if op == "norm_fwd" and op in winners:  # the bwd sweep runs with the best fwd
            configs._OVERRIDES["norm_fwd"] = winners[op]
    configs._OVERRIDES.pop("norm_fwd", None)
    return winners


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).ljust(w) for k, w in zip(keys, widths, strict=True)), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--budget", type=float, default=230.0, help="seconds for the whole run")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of this script)")
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget)
    torch.manual_seed(0)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
    result: dict[str, Any] = dict(
        device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
        arch=configs.arch_key(torch.device(DEV)), fallback=configs.FALLBACK,
    )  # fmt: skip
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    liger = _liger()
    result["liger"] = bool(liger)
    bw = copy_tbs()
    result["copy_TBs"] = round(bw, 3)
    print(f"device {result['device']}  copy bandwidth {bw:.3f} TB/s  liger={bool(liger)}", flush=True)
    shapes = [(64, 256), (16, 256)] if args.smoke else [(16384, 4096), (4096, 4096)]
    ops: list[dict[str, Any]] = []
    big_bf16: list[dict[str, Any]] = []
    for rows, hidden in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            if not deadline.ok(f"ops {rows}x{hidden} {dtype}", 30):
                continue
            cases = op_cases(rows, hidden, dtype)
            for c in cases:
                variants = {"eager": c["eager"], "fast": c["fast"]}
                if c["name"] in liger:
                    variants["liger"] = liger[c["name"]]
                row = measure(c, variants, bw)
                row.update(shape=f"{rows}x{hidden}", dtype=str(dtype).replace("torch.", ""))
                ops.append(row)
            if (rows, hidden) == shapes[0] and dtype == torch.bfloat16:
                big_bf16 = cases
            else:
                del cases
            tag = (f"{rows}x{hidden}", str(dtype).replace("torch.", ""))
            _print(f"ops fwd+bwd {tag[0]} {tag[1]}", [r for r in ops if (r["shape"], r["dtype"]) == tag])
    result["ops"] = ops
    if deadline.ok("linear_cross_entropy", 40):
        result["lce"] = lce_rows(args.smoke, liger, deadline)
        from fastpipe.kernels import cross_entropy

        # Whether "accumulate" got torch's addmm(out_dtype=fp32) or fell back to a bf16 product + add.
        result["lce_addmm_out_dtype"] = dict(cross_entropy._OUT_DTYPE_MM)
        _print("linear_cross_entropy fwd+bwd, bf16 (one row per strategy/chunk candidate)", result["lce"])
    if deadline.ok("blocks", 40):
        result["blocks"] = block_rows(torch.bfloat16, args.smoke)
        _print("blocks fwd+bwd, bf16: eager, eager+checkpoint, fastpipe", result["blocks"])
    if not args.no_tune and big_bf16 and deadline.ok("tuning", 30):
        winners = tune(big_bf16, deadline)
        result["tuned"] = winners
        arch = result["arch"]
        literal = {arch: {op: {"*": cfg} for op, cfg in winners.items()}}
        print(f"\nTUNED literal for kernels/configs.py (measured {time.strftime('%Y-%m-%d')}):\nTUNED = {literal!r}")
    result["skipped"] = deadline.skipped
    result["seconds_left"] = round(deadline.left(), 1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    summary = {
        "copy_TBs": result["copy_TBs"],
        "ops": {f"{r['op']}|{r['shape']}|{r['dtype']}": [r.get("x_eager"), r.get("x_liger"), r.get("pct_copy_bw")]
                for r in ops},
        "lce": [[r.get("strategy"), r.get("chunk_ratio"), r.get("fast_ms"), r.get("fast_mib"), r.get("x_eager")]
                for r in result.get("lce", [])],
        "blocks": {r["op"]: [r.get("x_eager_ckpt"), r.get("saved_ratio")] for r in result.get("blocks", [])},
        "lce_addmm_out_dtype": result.get("lce_addmm_out_dtype"), "tuned": result.get("tuned"),
        "skipped": deadline.skipped,
    }  # fmt: skip
    print("JSON " + json.dumps(summary, default=str))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
