"""A layer that runs its own ``torch.utils.checkpoint`` can be measured, and trained under ``memory_limit``."""

from __future__ import annotations

import torch
from _memory_utils import install_counter_or_skip
from fp_tolerance import assert_close_reordered
from torch import nn
from torch.utils.checkpoint import checkpoint


class _CheckpointedMLP(nn.Module):
    """Its Linears run under non-reentrant checkpointing: their saved tensors are recomputed in the backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.mlp, x, use_reentrant=False)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 32), _CheckpointedMLP(32), _CheckpointedMLP(32), nn.Linear(32, 8))


def test_a_stage_whose_layers_checkpoint_themselves_is_measured_with_the_weight_pass() -> None:
    install_counter_or_skip()
    from fastpipe.memory.stage_bytes import measure_stages

    model = _model()
    x = torch.randint(0, 16, (4, 6))  # integers: no input gradient, so W is the first to reach the regions
    (found,) = measure_stages(model, [len(model)], x)
    assert found.parameters > 0 and found.activation > 0
    assert found.w_records > 0  # the Linears' (x, dy) left for W, recomputed inside the regions


def test_memory_limit_trains_layers_that_checkpoint_themselves_exactly() -> None:
    install_counter_or_skip()
    from fastpipe import Pipe

    x, y = torch.randint(0, 16, (8, 6)), torch.randn(8, 6, 8)
    plain = _model()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    pipe = Pipe(_model(), balance=[2, 2], chunks=4, schedule="zb-h1", checkpoint="never", memory_limit="1GiB")
    pipe.train_step(x, y, torch.nn.functional.mse_loss)
    for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters()):
        assert ours.grad is not None, name
        assert_close_reordered(ours.grad, theirs.grad, k=64)
