"""Zero-bubble schedules on 2 gloo ranks: the V placement decides who holds what, and the numbers match.

``zb-h2`` runs one stage per rank, ``zb-v`` and ``dualpipev`` four stages on two ranks in a V (rank 0
holds stages 0 and 3, rank 1 stages 1 and 2), so the loss is computed on rank 0. Each run is compared
with the one-process :class:`fastpipe.Pipe` under the same schedule (the same arithmetic: bitwise)
and with the plain model (reordered sums: within rounding), for every checkpoint mode.
"""

from __future__ import annotations

import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import close_reordered
from torch import nn

HIDDEN = 8
K = 8 * HIDDEN + HIDDEN + 16  # reductions from input to loss, plus the rows a weight gradient sums over
CASES = [("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(8)])


def _run(rank: int, world: int) -> list[str]:
    from fastpipe import Pipe
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
    for name, v in CASES:
        stages = world * v
        balance = [8 // stages] * stages
        held = [s for s in range(stages) if (s if s < world else 2 * world - 1 - s) == rank] if v == 2 else [rank]
        pipe = DistributedPipe(make_model(), balance, chunks=4, schedule=name, timeout=20)
        if sorted(pipe.stages) != held:
            problems.append(f"{name}: rank {rank} holds stages {sorted(pipe.stages)}, not {held}")
        local = Pipe(make_model(), balance, chunks=4, schedule=name, virtual_stages=v)
        plain = make_model()
        for checkpoint in ("never", "except_last", "always"):  # one pipe: the mode is read at each step
            pipe.checkpoint = local.checkpoint = checkpoint
            for module in (pipe, local, plain):
                module.zero_grad(set_to_none=True)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
            expected = local.train_step(x, y, nn.MSELoss())
            plain_loss = nn.MSELoss()(plain(x), y)
            plain_loss.backward()
            where = f"{name}, checkpoint={checkpoint}"
            if not torch.equal(loss, expected):
                problems.append(f"{where}: loss {loss.item()} != local {expected.item()}")
            if not close_reordered(loss, plain_loss, k=K):
                problems.append(f"{where}: loss {loss.item()} != plain {plain_loss.item()}")
            ref_local, ref_plain = dict(local.named_parameters()), dict(plain.named_parameters())
            names = [n for n, _ in pipe.named_parameters()]
            if len(names) != 2 * sum(balance[s] for s in held):
                problems.append(f"{where}: rank {rank} holds parameters {names}")
            for n, p in pipe.named_parameters():
                if p.grad is None or not torch.equal(p.grad, ref_local[n].grad):
                    problems.append(f"{where}: grad of {n} differs from the local Pipe")
                elif not close_reordered(p.grad, ref_plain[n].grad, k=K):
                    problems.append(f"{where}: grad of {n} differs from the plain Sequential")
        pipe.close()
        local.close()
    return problems


def test_zero_bubble_schedules_equal_one_process_and_the_plain_model(transport: str) -> None:
    for rank, problems in enumerate(check_ok(run_ranks(_run, 2, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"


def _refusals(rank: int, world: int) -> list[str]:
    from fastpipe.distributed_pipe import DistributedPipe
    from fastpipe.schedule.builders import build_for

    messages = []
    for balance, schedule, chunks in (([2, 2, 2, 2], "zb-h2", 4), ([4, 4], "zb-v", 4), ([2, 2, 2, 2], "dualpipev", 3)):
        try:
            DistributedPipe(make_model(), balance, chunks=chunks, schedule=schedule, timeout=20)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("built")
    # A runtime built for the V refuses a round-robin (interleaved) schedule of the same stages.
    pipe = DistributedPipe(make_model(), [2, 2, 2, 2], chunks=4, schedule="zb-v", timeout=20)
    try:
        pipe.runtime.train(build_for("interleaved", 4, 2, 4), None, None, checkpoint=lambda m: False)  # type: ignore[arg-type]
    except ValueError as exc:
        messages.append(str(exc))
    finally:
        pipe.close()
    return messages


def test_distributed_pipe_refuses_what_does_not_fit_the_placement() -> None:
    for messages in check_ok(run_ranks(_refusals, 2, timeout=60)):
        assert "need schedule='interleaved', 'zb-v' or 'dualpipev'" in messages[0]
        assert "zb-v runs 2 stages per worker in a V: 4 stages on 2 workers; got 2 stages" in messages[1]
        assert "at least as many micro-batches as stages: 4" in messages[2]
        assert "places the stages on ranks [0, 1, 0, 1]" in messages[3] and "[0, 1, 1, 0]" in messages[3]


def _given(rank: int, world: int) -> tuple[list[str], list[str]]:
    from fastpipe import Pipe, PipelineError
    from fastpipe.distributed_pipe import DistributedPipe
    from fastpipe.schedule import build
    from fastpipe.schedule.builders import build_for
    from fastpipe.schedule.fuse import fuse_backward

    problems, messages = [], []
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
    fused = fuse_backward(build("zb-v", world, 4))
    pipe = DistributedPipe(make_model(), [2, 2, 2, 2], chunks=4, schedule="zb-v", timeout=20)
    local = Pipe(make_model(), [2, 2, 2, 2], chunks=4, schedule="zb-v", virtual_stages=2)
    args = (x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    loss = pipe.train_step(*args, schedule=fused, trace=True)
    expected = local.train_step(x, y, nn.MSELoss(), schedule=fused)
    if not torch.equal(loss, expected):
        problems.append(f"loss {loss.item()} != local {expected.item()}")
    ref = dict(local.named_parameters())
    for n, p in pipe.named_parameters():
        if p.grad is None or not torch.equal(p.grad, ref[n].grad):
            problems.append(f"grad of {n} differs from the local Pipe")
    ran = {e.action for e in pipe.last_timeline.events}
    mine = {str(a) for a in fused.workers[rank]}
    if not mine <= ran or not any("BW" in a for a in ran):
        problems.append(f"rank {rank} ran {sorted(ran)}, not the given schedule's {sorted(mine)}")
    for bad in (fuse_backward(build("zb-v", world, 8)), build_for("interleaved", 4, world, 4)):
        try:  # every rank refuses alike, and the pipe stays usable
            pipe.train_step(*args, schedule=bad)
        except ValueError as exc:
            messages.append(str(exc))
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(*args)
    try:  # rank 1 passes no schedule: it raises, rank 0 learns it
        pipe.train_step(*args, schedule=fused if rank == 0 else None)
    except (ValueError, PipelineError) as exc:
        messages.append(f"{type(exc).__name__}: {exc}")
    pipe.close()
    local.close()
    return problems, messages


def test_distributed_train_step_runs_a_given_schedule(transport: str) -> None:
    for rank, (problems, messages) in enumerate(check_ok(run_ranks(_given, 2, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"
        assert "is for 4 stages and 8 micro-batches" in messages[0]
        assert "places the stages on ranks [0, 1, 0, 1]" in messages[1]
        if rank == 1:
            assert messages[2].startswith("ValueError") and "is not stage 0's rank's" in messages[2]
        else:
            assert messages[2].startswith("PipelineError") and "is not stage 0's rank's" in messages[2]
