"""``SizeProbe``: the sizes offload would take from a forward, found without holding its activations.

The memory guard and the planner run each stage's forward once to learn what offload can take.
:class:`~fastpipe.runtime.offload.SavedSet` holds every saved tensor to the forward's end to tell
which only autograd holds; the probe must pick the same tensors through weak references, so the
measure does not hold a whole stage's activations on the device that offload is there to relieve.
"""

import contextlib

import torch
import torch.nn.functional as F
from _memory_utils import install_counter_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe.memory.accounting import PeakMeter
from fastpipe.memory.offload_bytes import OffloadBytes
from fastpipe.runtime.host_copies import CopyPath
from fastpipe.runtime.offload import SavedSet, SizeProbe, saving_hooks
from fastpipe.runtime.stage import Stage

D = 16


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.norm = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (h.view(b, t, 2, D // 2).transpose(1, 2) for h in self.qkv(self.norm(x)).split(D, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, D))


class _Kept(nn.Module):
    """Keeps a saved tensor on the module: not only autograd's, so never offloaded."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = torch.tanh(self.lin(x))
        return self.kept * 2


class _ViewOut(nn.Module):
    """Returns a view of a saved tensor: its storage outlives the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sigmoid().view_as(x)


class _InPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x * 3, inplace=True).exp()


class _Tied(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lin.weight).cos()


def _catalog() -> list[nn.Module]:
    shared = nn.Linear(D, D, bias=False)
    mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
    return [
        _Attention(), mlp, _Kept(), _ViewOut(), _InPlace(), nn.Sequential(nn.Dropout(0.3), nn.SiLU()),
        nn.Sequential(shared, nn.GELU()), _Tied(shared), nn.BatchNorm1d(8), nn.Softmax(-1),
    ]  # fmt: skip


def _saved_sizes(module: nn.Module, x: torch.Tensor, scope: frozenset[int] | None, probe: bool) -> list[int]:
    path = CopyPath(torch.device("cpu"), force=True)
    torch.manual_seed(0)
    if probe:
        found = SizeProbe(path)
        with found.outside(), saving_hooks(module, scope, found):
            out = module(x)
        sizes = found.sizes()
    else:
        saved = SavedSet(path)
        with contextlib.nullcontext(), saving_hooks(module, scope, saved):
            out = module(x)
        sizes = [r.nbytes for r in saved.candidates()]
        saved.release()
    del out
    return sizes


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True),
    st.one_of(st.none(), st.frozensets(st.integers(0, 5))),
    st.booleans(),
)
def test_the_probe_finds_what_the_saved_set_would_offload(layers: list[int], scope, grad: bool) -> None:
    catalog = _catalog()
    module = nn.Sequential(*[catalog[i] for i in layers])
    x = torch.randn(2, 8, D, requires_grad=grad)
    assert _saved_sizes(module, x, scope, probe=True) == _saved_sizes(module, x, scope, probe=False)


def test_measuring_what_a_stage_offloads_holds_none_of_its_activations() -> None:
    install_counter_or_skip()
    width, rows, depth = 64, 512, 8
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)]
    stage = Stage(nn.Sequential(*blocks), torch.device("cpu"))
    x = torch.randn(rows, width)
    with PeakMeter("cpu") as meter:
        (sizes,) = OffloadBytes([stage]).sizes(x, None, None, (None,))
    activation = sum(sizes)
    assert activation >= depth * 2 * rows * 4 * width * 4  # each block saves its hidden layer twice (GELU in and out)
    # One block's temporaries at a time, not the stage's 9.3 MB of saved activations.
    assert meter.result.peak < activation / 4, (str(meter.result), activation)
