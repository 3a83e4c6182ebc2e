"""The largest model of the workload family that trains on one device: plain, recompute, recompute + fused.

GPipe's memory claim is about how large a model fits, not how fast it runs (about 25× larger
models on 8 accelerators). Here, per residual-MLP block of the workload, at the benchmark's
batch:

* ``state``: parameters, gradients and two AdamW moments, 16 bytes per parameter (fp32);
* ``saved``: the bytes autograd keeps for backward (saved-tensor hooks, parameters left out);
  ``plain`` keeps every block's, ``recompute`` (``torch.utils.checkpoint`` per block) only each
  block's input plus one block's ``saved`` during its backward, ``recompute + fused`` the same
  with ``fastpipe.kernels.MLPBlock``, whose recomputed block saves about half; ``fused`` (no
  recomputation) shows the kernels' own saving.

The largest block count N under a memory budget C is then
``N (state + kept) + transient ≤ C``: a bound, as if every state and activation were alive at
once (in a real step the gradients grow while the activations are freed). On a GPU the budget
is 90% of the device's memory and the prediction is checked against
``torch.cuda.max_memory_allocated`` of a real step at a small N; on CPU (no device limit) the
figures are the saved bytes, and the block counts are for a stated 16 GiB budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastpipe import kernels
from fastpipe.bench.workload import ResidualMLP
from fastpipe.kernels.memory import count_saved_bytes
from fastpipe.trace.plotting import pyplot

__all__ = ["run_memory"]

_CPU_BUDGET = 16 * 2**30
_MODES = ("plain", "fused", "recompute", "recompute + fused")


class _Recomputed(nn.Module):
    """A block whose activations are recomputed in backward; only its input is kept."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _block(mode: str, hidden: int, ffn: int) -> nn.Module:
    if mode == "plain":
        return ResidualMLP(hidden, ffn)
    if mode == "fused":
        return kernels.MLPBlock(hidden, ffn)
    inner = kernels.MLPBlock(hidden, ffn) if mode == "recompute + fused" else ResidualMLP(hidden, ffn)
    return _Recomputed(inner)


def _model(mode: str, blocks: int, hidden: int, ffn: int, device: torch.device) -> nn.Sequential:
    return nn.Sequential(*[_block(mode, hidden, ffn) for _ in range(blocks)]).to(device)


def _per_block(mode: str, hidden: int, ffn: int, batch: int, device: torch.device) -> dict[str, int]:
    block = _block(mode, hidden, ffn).to(device)
    inner = block.block if isinstance(block, _Recomputed) else block
    x = torch.randn(batch, hidden, device=device, requires_grad=True)
    kept, _ = count_saved_bytes(lambda: block(x), block.parameters())
    saved, _ = count_saved_bytes(lambda: inner(x), inner.parameters())  # what one block holds while it runs
    params = sum(p.numel() for p in block.parameters())
    return {"state": 16 * params, "kept": kept, "transient": saved, "params": params}


def _largest(b: dict[str, int], budget: float) -> int:
    return max(0, int((budget - b["transient"]) // (b["state"] + b["kept"])))


def _measured_peak(mode: str, blocks: int, hidden: int, ffn: int, batch: int, device: torch.device) -> int:
    """Peak bytes allocated during a steady-state step (forward, backward, AdamW), above what was there before.

    The second step is measured, when AdamW's moments already exist, as in every later step;
    ``foreach=False`` keeps the optimizer's temporaries to one parameter's size.
    """
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    model = _model(mode, blocks, hidden, ffn, device)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(batch, hidden, device=device)
    for i in range(2):
        if i == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, opt, x
    torch.cuda.empty_cache()
    return peak


def run_memory(hidden: int, ffn: int, batches: list[int], check_blocks: int = 4) -> dict[str, Any]:
    """Per-block bytes, the largest model per mode and batch, and its ratio to plain."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    budget = 0.9 * torch.cuda.get_device_properties(device).total_memory if cuda else _CPU_BUDGET
    rows = []
    for batch in batches:
        plain = 1
        for mode in _MODES:
            b = _per_block(mode, hidden, ffn, batch, device)
            row: dict[str, Any] = {
                "batch": batch,
                "mode": mode,
                "params": b["params"],
                "state_bytes": b["state"],
                "kept_bytes": b["kept"],
                "transient_bytes": b["transient"],
                "largest_blocks": _largest(b, budget),
            }
            if mode == "plain":
                plain = max(row["largest_blocks"], 1)
            row["ratio_to_plain"] = row["largest_blocks"] / plain
            if cuda:
                predicted = check_blocks * (b["state"] + b["kept"]) + b["transient"]
                measured = _measured_peak(mode, check_blocks, hidden, ffn, batch, device)
                row.update(check_blocks=check_blocks, predicted_peak_bytes=predicted, measured_peak_bytes=measured)
            rows.append(row)
    return {
        "device": str(device),
        "budget_bytes": budget,
        "budget": "90% of device memory" if cuda else "16 GiB (stated; no device limit on CPU)",
        "hidden": hidden,
        "ffn": ffn,
        "batches": batches,
        "rows": rows,
        "reference": "GPipe (Huang et al. 2019): about 25x larger models on 8 accelerators",
    }


def plot_memory(result: dict[str, Any], path: str) -> None:
    """Bars of the largest trainable block count per mode, one group per batch."""
    plt = pyplot()

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(_MODES)
    for j, mode in enumerate(_MODES):
        sel = [r for r in rows if r["mode"] == mode]
        xs = [i + j * width for i in range(len(sel))]
        ax.bar(xs, [r["largest_blocks"] for r in sel], width, label=mode)
        for x, r in zip(xs, sel):
            ax.text(x, r["largest_blocks"], f"{r['ratio_to_plain']:.1f}x", ha="center", va="bottom", fontsize=7)
    centre = (len(_MODES) - 1) * width / 2
    ax.set_xticks([i + centre for i in range(len(result["batches"]))], [f"batch {b}" for b in result["batches"]])
    ax.set_ylim(0, 1.12 * max((r["largest_blocks"] for r in rows), default=1))  # room for the ratio labels
    ax.set_ylabel("largest model (blocks)")
    ax.set_title(f"one device, budget {result['budget_bytes'] / 2**30:.0f} GiB")
    # Beside the axes, not over them: the tallest bars reach the top on every host.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="mode", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
