"""Skips between ranks (gloo, spawned): a DistributedPipe with skips gives the one-process numbers.

Each skip goes straight from the producer's rank to the consumer's, and the losses and
gradients equal the local Pipe's bit for bit (the same micro-batches, the same arithmetic)
and the plain model's within rounding.
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _unet import K, unet
from fp_tolerance import close_reordered
from torch import nn

# d1 and d2 both cross from rank 0 to rank 1; interleaved, d1 crosses (stage 0 -> 3) and
# d2 stays on rank 1 (stage 1 -> 3).
RUNS = [("gpipe", 1, [6, 5]), ("1f1b", 1, [6, 5]), ("zb-h1", 1, [6, 5]), ("interleaved", 2, [3, 3, 2, 3])]


def recorded(transport) -> list[tuple[int, int, int]]:
    """The keys ``(kind, stage, micro-batch)`` of the values ``transport`` sends to other ranks, from now on."""
    sent: list[tuple[int, int, int]] = []
    send = transport._send

    def spy(kind, stage, microbatch, *args):
        sent.append((kind, stage, microbatch))
        return send(kind, stage, microbatch, *args)

    transport._send = spy
    return sent


def _train(rank: int, world: int) -> list[str]:
    from fastpipe import Pipe
    from fastpipe.distributed.wire import skip_kind
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    for (name, v, balance), checkpoint in zip(RUNS, ["always", "except_last", "never", "except_last"]):
        pipe = DistributedPipe(unet(), balance, chunks=4, schedule=name, checkpoint=checkpoint, timeout=20)
        local = Pipe(unet(), balance, chunks=4, schedule=name, virtual_stages=v, checkpoint=checkpoint)
        plain = unet()
        sent = recorded(pipe.runtime.transport)
        for step in range(2):  # the second step reuses the receive buffers
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
            expected = local.train_step(x, y, nn.MSELoss())
            plain_loss = nn.MSELoss()(plain(x), y)
            plain_loss.backward()
            if not torch.equal(loss, expected):
                problems.append(f"{name} step {step}: loss {loss.item()} != local {expected.item()}")
            if not close_reordered(loss, plain_loss, k=K):
                problems.append(f"{name} step {step}: loss {loss.item()} != plain {plain_loss.item()}")
        if rank == 0:  # d1 (and d2 but interleaved) went straight to the last stage, once per micro-batch
            skips = sorted({(k, s) for k, s, _ in sent if k >= 2})
            want = [(skip_kind(0), 3)] if v == 2 else [(skip_kind(0), 1)]
            if skips != want or sum(1 for k, *_ in sent if k >= 2) != 2 * 4:
                problems.append(f"{name}: rank 0 sent skips {sorted(sent)}")
        ref_local, ref_plain = dict(local.named_parameters()), dict(plain.named_parameters())
        for n, p in pipe.named_parameters():
            if p.grad is None or not torch.equal(p.grad, ref_local[n].grad):
                problems.append(f"{name}: grad of {n} differs from the local Pipe")
            elif not close_reordered(p.grad, ref_plain[n].grad, k=K):
                problems.append(f"{name}: grad of {n} differs from the plain Sequential")
        pipe.close()
    return problems


@pytest.mark.parametrize("transport", ["tags", "ordered"])
def test_skips_between_ranks_give_the_one_process_numbers(transport: str, monkeypatch) -> None:
    if transport == "ordered":  # the order-matched transport of NCCL, run on gloo
        monkeypatch.setenv("FASTPIPE_P2P", "ordered")  # inherited by the spawned ranks
    for rank, problems in enumerate(check_ok(run_ranks(_train, 2, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"


def _bad(rank: int, world: int) -> str:
    from fastpipe import pops
    from fastpipe.distributed_pipe import DistributedPipe

    model = unet()
    model[9] = pops(nn.Tanh(), "d1", "d3")  # no stash of "d3" anywhere
    try:
        DistributedPipe(model, [6, 5], chunks=2, timeout=20)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_a_bad_declaration_is_refused_on_every_rank() -> None:
    for message in check_ok(run_ranks(_bad, 2, timeout=60)):
        assert "layer '9' pops 'd3', but no layer stashes it" in message


def _three_ranks(rank: int, world: int) -> list[str]:
    from fastpipe import Pipe
    from fastpipe.distributed.wire import skip_kind
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    for name in ("1f1b", "zb-h1"):
        # d1 goes from rank 0 straight to rank 2, past rank 1; d2 from rank 1 to rank 2.
        pipe = DistributedPipe(unet(), [3, 5, 3], chunks=3, schedule=name, timeout=20)
        local = Pipe(unet(), [3, 5, 3], chunks=3, schedule=name)
        sent = recorded(pipe.runtime.transport)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(6, 6, generator=g), torch.randn(6, 3, generator=g)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        if not torch.equal(loss, local.train_step(x, y, nn.MSELoss())):
            problems.append(f"{name}: loss differs from the local Pipe")
        ref = dict(local.named_parameters())
        problems += [f"{name}: grad of {n}" for n, p in pipe.named_parameters() if not torch.equal(p.grad, ref[n].grad)]
        skips = sorted({(k, s) for k, s, _ in sent if k >= 2})
        want = {0: [(skip_kind(0), 2)], 1: [(skip_kind(1), 2)], 2: [(3 + 2 * 2, 0), (3 + 2 * 2, 1)]}[rank]
        if skips != want:
            problems.append(f"{name}: rank {rank} sent skip values {skips}, expected {want}")
        pipe.close()
    return problems


def test_the_order_matched_transport_carries_skips_past_a_rank(monkeypatch) -> None:
    monkeypatch.setenv("FASTPIPE_P2P", "ordered")
    for rank, problems in enumerate(check_ok(run_ranks(_three_ranks, 3, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"
