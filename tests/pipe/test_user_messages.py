"""What a user sees first: a warning where a Pipe would not pipeline, an error that says how to launch
DistributedPipe, torchgpipe's name, and objects that print what they hold."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import DistributedPipe, GPipe, Pipe, PipelineError


def model(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


# -- chunks=1 on several stages ---------------------------------------------------------------


def test_one_micro_batch_on_several_stages_warns_to_pass_chunks() -> None:
    with pytest.warns(UserWarning, match=r"chunks=1 .*4 stages one after another.*pass chunks=M.*chunks=16") as seen:
        Pipe(model(), balance=[1, 1, 1, 1])
    assert len([w for w in seen if "chunks=1" in str(w.message)]) == 1  # once per Pipe, not per stage
    assert seen[0].filename == __file__  # points at the caller's line, not into fastpipe


@pytest.mark.parametrize(
    "kwargs",
    [
        {"balance": [2, 2], "chunks": 4},  # pipelined
        {"balance": [4]},  # one stage: nothing to overlap
        {"balance": [1, 1, 1, 1], "chunks": 2, "schedule": "interleaved", "virtual_stages": 2},
    ],
)
def test_pipes_that_overlap_or_cannot_overlap_build_silently(kwargs: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipe(model(), **kwargs)


# -- DistributedPipe without a process group --------------------------------------------------


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not torch.distributed.is_initialized()


def test_distributed_pipe_outside_torchrun_says_how_to_launch(no_launcher: None) -> None:
    message = r"torchrun --nproc-per-node K script\.py.*init_process_group\(\"gloo\"\).*\(\"nccl\"\).*fastpipe\.Pipe"
    with pytest.raises(PipelineError, match=message):
        DistributedPipe(model(), [2, 2], chunks=4)
    with pytest.raises(PipelineError, match=message):
        DistributedPipe.from_stage_builder(lambda s: model(2), [2, 2], chunks=4)


def test_distributed_pipe_under_torchrun_without_a_group_says_to_init_it(
    no_launcher: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PipelineError, match=r"torchrun started this process, but call .*init_process_group") as err:
        DistributedPipe(model(), [2, 2], chunks=4)
    assert "--nproc-per-node" not in str(err.value)


# -- torchgpipe's name ------------------------------------------------------------------------

# torchgpipe 0.0.7's GPipe.__init__(module, balance=None, *, devices=None, chunks=1,
# checkpoint="except_last", deferred_batch_norm=False). fastpipe's checkpoint default is "auto"
# instead: the least recompute that fits the devices, with the same outputs and gradients.
TORCHGPIPE_DEFAULTS = {"devices": None, "chunks": 1, "checkpoint": "auto", "deferred_batch_norm": False}


def test_gpipe_is_pipe_and_takes_torchgpipes_arguments_with_their_defaults() -> None:
    assert GPipe is Pipe and "GPipe" in fastpipe.__all__
    params = inspect.signature(GPipe).parameters
    assert list(params)[:2] == ["module", "balance"]
    for name, default in TORCHGPIPE_DEFAULTS.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default, name


def test_gpipe_built_as_for_torchgpipe_computes_the_models_output() -> None:
    plain = model()
    x = torch.randn(8, 4)
    pipe = GPipe(
        model(), balance=[2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="except_last", deferred_batch_norm=False
    )
    assert_close_reordered(pipe(x), plain(x), k=16)


# -- what pipe.ties and pipe.last_timeline print -----------------------------------------------


def test_ties_print_each_shared_tensor_and_its_stages() -> None:
    embed, head = nn.Linear(4, 4), nn.Linear(4, 4)
    head.weight = embed.weight
    pipe = Pipe(nn.Sequential(embed, nn.ReLU(), head), balance=[2, 1], chunks=2)
    assert repr(pipe.ties) == "TiedWeights(Tie('0.weight' on stage 0 -> '2.weight' on stage 1, parameter))"
    assert repr(Pipe(model(2), balance=[1, 1], chunks=2).ties) == "TiedWeights(no tensor is shared across stages)"


def test_last_timeline_prints_its_size_makespan_and_bubble() -> None:
    pipe = Pipe(model(), balance=[2, 2], chunks=4, trace=True)
    pipe(torch.randn(8, 4)).sum().backward()
    timeline = pipe.last_timeline
    assert timeline is not None
    text = repr(timeline)
    match = re.fullmatch(r"Timeline\(2 workers, (\d+) events, makespan ([\d.]+) (µs|ms|s), bubble ([\d.]+)%\)", text)
    assert match is not None, text
    assert int(match.group(1)) == len(timeline.events)
    assert float(match.group(4)) == pytest.approx(100 * timeline.bubble_fraction, abs=0.05)
    assert repr(fastpipe.trace.timeline.Timeline(3)) == "Timeline(3 workers, no events)"


def test_distributed_ties_print_each_shared_tensor_and_its_ranks(tmp_path: Path) -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        embed, head = nn.Linear(4, 4), nn.Linear(4, 4)
        head.weight = embed.weight
        pipe = DistributedPipe(nn.Sequential(embed, nn.ReLU(), head), [2, 1], chunks=2, schedule="interleaved")
        assert repr(pipe.ties) == (
            "RankTies(TieInfo(name='0.weight', reader_name='2.weight', owner_stage=0, reader_stage=1, ranks=(0,), "
            "is_parameter=True))"
        )
        pipe.close()
    finally:
        dist.destroy_process_group()
