"""The runtime's switches are constructor arguments, fixed when the pipe is built.

``fused_wgrad``, ``wgrad_batch``, ``wgrad_fuse_min`` and ``tune_malloc`` of ``Pipe`` and
``DistributedPipe``, and ``p2p`` of ``DistributedPipe`` (:mod:`fastpipe.runtime.options`): each
changes what a step does; where one is None, its ``FASTPIPE_*`` variable is read once, at
construction, and never by a step; a bad value is refused, naming those accepted. How
``wgrad_batch`` batches the GEMMs: test_weight_batches.py.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.distributed.ranks import order_matched
from fastpipe.runtime import threads, wgrad
from fastpipe.runtime.options import RuntimeOptions

VARIABLES = (
    "FASTPIPE_FUSED_WGRAD",
    "FASTPIPE_WGRAD_BATCH",
    "FASTPIPE_TUNE_MALLOC",
    "FASTPIPE_P2P",
    "FASTPIPE_WGRAD_FUSE_MIN",
)


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in VARIABLES:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def gemms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per GEMM that adds a Linear's weight gradient straight into its running sum."""
    calls: list[int] = []
    plain = wgrad._summed

    def counting(*args: Any) -> Any:
        calls.append(1)
        return plain(*args)

    monkeypatch.setattr(wgrad, "_summed", counting)
    return calls


@pytest.fixture
def tunes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per time a local runtime tunes the host allocator (the settings are process-wide)."""
    calls: list[int] = []
    monkeypatch.setattr(threads, "tune_host_allocator", lambda: calls.append(1) or True)
    return calls


def _pipe(**switches: Any) -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    return Pipe(model, balance=[2, 1], chunks=2, checkpoint="never", **switches)


def _step(pipe: Pipe, schedule: str = "1f1b") -> None:
    x, y = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6)
    pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("fused_wgrad", "yes", "True or False"),
        ("fused_wgrad", 1, "True or False"),
        ("tune_malloc", "0", "True or False"),
        ("wgrad_batch", 0, r"a whole number >= 1 \(1: each W runs its own micro-batch's GEMM\) or None"),
        ("wgrad_batch", 2.0, "a whole number >= 1"),
        ("wgrad_batch", True, "a whole number >= 1"),
        ("wgrad_fuse_min", -1, r"a whole number >= 0 \(0: every Linear sums in its GEMM\) or None"),
        ("wgrad_fuse_min", 1.5, "a whole number >= 0"),
        ("wgrad_fuse_min", False, "a whole number >= 0"),
    ],
)
def test_a_bad_keyword_is_refused_naming_the_accepted_values(name: str, value: Any, accepted: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be {accepted}"):
        _pipe(**{name: value})


def test_a_bad_transport_is_refused_naming_the_accepted_values() -> None:
    with pytest.raises(ValueError, match="p2p must be 'tags', 'ordered' or None"):
        RuntimeOptions.resolve(p2p="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="p2p must be 'tags', 'ordered' or None"):
        order_matched("gloo", "fifo")
    with pytest.raises(ValueError, match="p2p='tags' cannot work on NCCL, which ignores tags"):
        order_matched("nccl", "tags")
    assert order_matched("nccl", None) and order_matched("gloo", "ordered")
    assert not order_matched("gloo", None) and not order_matched("gloo", "tags")


@pytest.mark.parametrize(
    "var, text, name, accepted",
    [
        ("FASTPIPE_FUSED_WGRAD", "yes", "fused_wgrad", "0 or 1"),
        ("FASTPIPE_TUNE_MALLOC", "off", "tune_malloc", "0 or 1"),
        ("FASTPIPE_WGRAD_BATCH", "two", "wgrad_batch", "a whole number >= 1"),
        ("FASTPIPE_WGRAD_FUSE_MIN", "-3", "wgrad_fuse_min", "a whole number >= 0"),
    ],
)
def test_a_bad_variable_is_refused_when_the_pipe_is_built(
    monkeypatch: pytest.MonkeyPatch, var: str, text: str, name: str, accepted: str
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=rf"{var} must be {accepted}.*or pass {name}="):
        _pipe()
    valid = {"wgrad_batch": 1, "wgrad_fuse_min": 0}.get(name, True)
    _pipe(**{name: valid})  # a keyword given: its variable is not read


def test_a_bad_transport_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPIPE_P2P", "fifo")
    with pytest.raises(ValueError, match=r"FASTPIPE_P2P must be 'tags' or 'ordered'.*or pass p2p="):
        RuntimeOptions.resolve()
    assert RuntimeOptions.resolve(p2p="ordered").p2p == "ordered"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fused_wgrad_decides_whether_linears_sum_in_their_gemm(gemms: list[int], schedule: str) -> None:
    for fused in (False, True):
        gemms.clear()
        pipe = _pipe(fused_wgrad=fused, wgrad_fuse_min=0)
        _step(pipe, schedule)
        assert bool(gemms) == fused, (fused, len(gemms))
        assert bool(pipe.runtime.stages[0].linears) == fused == bool(pipe.runtime.stages[0].early)


def test_on_cpu_only_large_weights_sum_in_their_gemm_by_default(gemms: list[int]) -> None:
    """Small Linears leave a combined backward's weight gradient to autograd; a split one defers them all."""
    pipe = _pipe()
    stage = pipe.runtime.stages[0]
    assert len(stage.linears) == 1 and stage.summing == []  # Linear(6, 8): 48 elements, under 2**17
    _step(pipe, "1f1b")
    assert gemms == []
    _step(pipe, "zb-h1")  # W is a GEMM over B's records whatever the size
    assert gemms
    assert RuntimeOptions().wgrad_fuse_min_on(torch.device("cuda")) == 0


def test_wgrad_fuse_min_picks_the_linears_by_weight_size(gemms: list[int]) -> None:
    torch.manual_seed(0)
    big, small = nn.Linear(512, 256), nn.Linear(256, 8)  # 131072 elements: at the default bound
    model = nn.Sequential(big, nn.Tanh(), small)
    plain = copy.deepcopy(model)
    pipe = Pipe(model, balance=[3], chunks=2, checkpoint="never")
    assert pipe.runtime.stages[0].summing == [big]
    x, y = torch.randn(4, 512), torch.randn(4, 8)
    pipe.train_step(x, y, nn.MSELoss(), schedule="1f1b")
    assert len(gemms) == 2  # the large Linear, once per micro-batch
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (nn.functional.mse_loss(plain(xs), ys) / 2).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_close_reordered(p.grad, q.grad, k=x.shape[1] + x.shape[0])
    for least, summing in ((48, [1, 1]), (49, [0, 0])):  # both Linears of _pipe hold 48 elements
        assert [len(s.summing) for s in _pipe(wgrad_fuse_min=least).runtime.stages] == summing


def test_tune_malloc_decides_whether_the_first_step_tunes_the_allocator(tunes: list[int]) -> None:
    pipe = _pipe(tune_malloc=False)
    _step(pipe)
    assert tunes == []
    pipe = _pipe(tune_malloc=True)
    assert tunes == []  # before the workers' first allocation, not before
    _step(pipe)
    _step(pipe)
    assert tunes == [1]


def test_the_variables_are_read_once_when_the_pipe_is_built(
    monkeypatch: pytest.MonkeyPatch, gemms: list[int], tunes: list[int]
) -> None:
    for var, text in zip(VARIABLES, ("0", "1", "0")):
        monkeypatch.setenv(var, text)
    pipe = _pipe()
    for var, text in zip(VARIABLES, ("1", "none", "1", "fifo")):  # new values, and bad ones: none is read
        monkeypatch.setenv(var, text)
    _step(pipe, "zb-h1")
    assert gemms == [] and tunes == []  # built unfused and untuned
    assert [st.wgrad_batch for st in pipe.runtime.stages] == [1, 1]


def test_a_keyword_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, text in zip(VARIABLES, ("0", "1", "0", "tags")):
        monkeypatch.setenv(var, text)
    pipe = _pipe(fused_wgrad=True, wgrad_batch=3, tune_malloc=True)
    assert all(st.linears and st.wgrad_batch == 3 for st in pipe.runtime.stages)
    assert pipe.runtime.tune_malloc
    assert RuntimeOptions.resolve(p2p="ordered").p2p == "ordered"


def _two_transports(rank: int, world: int) -> dict[str, Any]:
    from fastpipe.distributed_pipe import DistributedPipe

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    os.environ["FASTPIPE_P2P"] = "ordered"
    by_variable = DistributedPipe(model(), [2, 2], chunks=2, timeout=20)
    os.environ["FASTPIPE_P2P"] = "fifo"  # read by neither: the first was built, the second gets p2p=
    by_keyword = DistributedPipe(model(), [2, 2], chunks=2, timeout=20, p2p="tags", fused_wgrad=False, wgrad_batch=3)
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    for name, pipe in (("variable", by_variable), ("keyword", by_keyword)):
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        stages = list(pipe.runtime.stages.values())
        out[name] = (
            type(pipe.runtime.transport).__name__,
            loss.item(),
            [(bool(s.linears), s.wgrad_batch) for s in stages],
        )
        pipe.close()
    return out


def test_a_distributed_pipe_takes_its_transport_and_switches_when_built() -> None:
    for result in check_ok(run_ranks(_two_transports, 2, timeout=90)):
        assert result["variable"][0] == "OrderedTransport" and result["keyword"][0] == "P2PTransport"
        assert result["variable"][1] == result["keyword"][1]  # the same forward, bit for bit
        assert result["variable"][2] == [(True, 2)] and result["keyword"][2] == [(False, 3)]
