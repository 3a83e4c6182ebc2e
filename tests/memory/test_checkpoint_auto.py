"""Recompute as the memory model counts it, and ``checkpoint="auto"`` choosing by it.

One stage in one process, so the exact CPU counter (:mod:`fastpipe.memory._cpu_counter`)
counts that device alone; GPipe's order holds every micro-batch's activations at once, so
what recompute saves shows in the peak.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from _memory_utils import install_counter_or_skip
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import predict_memory
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule.builders import build
from fastpipe.step.recompute_policy import Recompute

transformers = pytest.importorskip("transformers")
from fastpipe.hf import causal_lm_loss, to_sequential  # noqa: E402 - needs transformers

VOCAB, T, D, ROWS, M = 256, 64, 64, 4, 4


def gpt2(d: int = D) -> nn.Sequential:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=d, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return to_sequential(transformers.GPT2LMHeadModel(cfg))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS * M, T), generator=torch.Generator().manual_seed(1))


def counted_peak(checkpoint: object, tokens: torch.Tensor) -> int:
    """The bytes one GPipe step holds at its peak above what was there before (parameters), counted."""
    seq = gpt2()
    pipe = Pipe(seq, [len(seq)], chunks=M, checkpoint=checkpoint, schedule="gpipe")  # type: ignore[arg-type]
    try:
        pipe.train_step(tokens, tokens, causal_lm_loss)  # the first step builds what later steps reuse
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        from fastpipe.memory.accounting import PeakMeter

        with PeakMeter("cpu") as meter:
            pipe.train_step(tokens, tokens, causal_lm_loss)
    finally:
        pipe.close()
    return meter.result.peak


def test_the_counted_peak_with_mlp_recompute_lies_between_never_and_always_within_5_percent() -> None:
    tokens = ids()
    install_counter_or_skip()  # before the models exist
    never, mlp, always = (counted_peak(c, tokens) for c in ("never", "mlp", "always"))
    assert always < mlp < never
    seq = gpt2()
    sample = tokens[:ROWS]
    stages = measure_stages(
        seq, [len(seq)], sample, loss_fn=causal_lm_loss, target=sample, recompute=Recompute(parts=("mlp",))
    )
    (device,) = predict_memory(build("gpipe", 1, M), stages, wgrad_batch=2)
    assert device.total - device.parameters == pytest.approx(mlp, rel=0.05)


class KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(input=self.norm(x))

    def fastpipe_parts(self) -> dict[str, nn.Module]:
        return {"mlp": self.mlp}


def test_a_region_called_with_a_keyword_keeps_that_input_and_the_model_counts_it() -> None:
    # The norm's output lives on only as the recomputed MLP's input: the region must keep it,
    # as a tensor autograd saves, so that measure_stages sees it (norm output + stage output).
    torch.manual_seed(0)
    model = nn.Sequential(KeywordBlock())
    x = torch.randn(32, D)
    (stage,) = measure_stages(model, [1], x, transients=False, recompute=Recompute(parts=("mlp",)))
    row = 32 * D * 4
    saved_by_norm = 32 * 2 * 4  # its mean and reciprocal deviation per row
    assert stage.activation == 2 * row + saved_by_norm


def pipe_under(limit: object, checkpoint: object = "auto", d: int = D) -> Pipe:
    seq = gpt2(d)
    return Pipe(seq, [len(seq)], chunks=M, checkpoint=checkpoint, schedule="gpipe", memory_limit=limit)  # type: ignore[arg-type]


def predicted_totals(tokens: torch.Tensor) -> dict[str, int]:
    """What the guard of a pipe like :func:`pipe_under`'s predicts for its device, per recompute."""
    pipe = pipe_under("1TiB", "never")
    try:
        guard = pipe.memory_guard
        assert guard is not None
        layers = [m for p in pipe.partitions for m in p]
        found = {}
        for name in ("never", "mlp", "always"):
            mode = Recompute(parts=("mlp",), name="mlp") if name == "mlp" else name
            sample = tokens[:ROWS]
            (device,) = guard.predict(
                layers, [len(layers)], build("gpipe", 1, M), mode, 2, sample, sample, causal_lm_loss
            )
            found[name] = device.total
        return found
    finally:
        pipe.close()


def test_auto_under_a_limit_that_fits_everything_recomputes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    tokens = ids()
    for limit in ("1TiB", None):
        pipe = pipe_under(limit)
        try:
            assert pipe.checkpoint_chosen is None
            with caplog.at_level(logging.INFO, logger="fastpipe"):
                pipe.train_step(tokens, tokens, causal_lm_loss)
            assert pipe.checkpoint_chosen == "never"
        finally:
            pipe.close()
    assert "checkpoint='auto' runs never under schedule gpipe" in caplog.text


def test_auto_under_a_tighter_limit_recomputes_and_the_counted_peak_stays_under_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = ids()
    install_counter_or_skip()  # before the models exist
    need = predicted_totals(tokens)
    limit = int(need["mlp"] * (1 + MARGIN)) + 1
    assert limit < need["never"] * (1 + MARGIN)
    from fastpipe.memory.accounting import PeakMeter

    pipe = pipe_under(limit)
    opt = torch.optim.Adam(pipe.parameters())
    try:
        with caplog.at_level(logging.INFO, logger="fastpipe"):
            pipe.train_step(tokens, tokens, causal_lm_loss)
        opt.step()  # its state, counted by the guard as Adam's, exists from here on
        assert str(pipe.checkpoint_chosen) == "mlp"
        assert pipe.memory_guard is not None and pipe.memory_guard.checkpoint == pipe.checkpoint_chosen
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu", modules=pipe, optimizers=opt) as meter:
            pipe.train_step(tokens, tokens, causal_lm_loss)
            opt.step()
    finally:
        pipe.close()
    # Parameters and Adam's state before the step, and the most the step added to them.
    assert meter.result.static_at_start + meter.result.peak <= limit
    assert "checkpoint='auto' runs mlp" in caplog.text


def test_auto_under_a_limit_below_every_candidate_raises_before_the_step() -> None:
    tokens = ids()[:, :8]
    pipe = pipe_under("16KiB", d=16)
    try:
        with pytest.raises(ValueError, match=r"over memory_limit=16\.00 KiB.*checkpoint='auto' tried.*never, mlp, "):
            pipe.train_step(tokens, tokens, causal_lm_loss)
        assert all(p.grad is None for p in pipe.parameters()), "no action ran"
        assert pipe.checkpoint_chosen is None
    finally:
        pipe.close()
