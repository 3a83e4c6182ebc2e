"""Stages sharded over their replicas (``dp_shard="fsdp"``, 2 stages x 2 shards on 4 gloo ranks).

Under every schedule the loss, the gradients (gathered whole) and the weights after an optimizer
step are one process's on the whole batch; each FSDP unit gathers its parameters and
reduce-scatters its gradients once per step, however many micro-batches the step has.
One spawn of the 4 ranks serves every test of the module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import close_reordered
from torch import nn

HIDDEN = 8
CHUNKS = 4
# Reductions from input to loss through 8 blocks, plus the rows a weight gradient sums over.
K = 8 * HIDDEN + HIDDEN + 16
RUNS = [
    ("gpipe", [4, 4], "tags"),
    ("1f1b", [4, 4], "tags"),
    ("zb-h1", [4, 4], "tags"),
    ("zb-h2", [4, 4], "tags"),
    ("interleaved", [2, 2, 2, 2], "tags"),
    ("zb-v", [2, 2, 2, 2], "tags"),
    ("dualpipev", [2, 2, 2, 2], "tags"),
    ("1f1b", [4, 4], "ordered"),  # the order-matched transport NCCL needs
]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(8)])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, HIDDEN, generator=g), torch.randn(16, HIDDEN, generator=g)


def counting_collectives() -> dict[str, int]:
    """Count the all-gathers and reduce-scatters that reach torch.distributed from now on, by kind."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "reduce_scatter": 0}
    for kind, names in {
        "all_gather": ("all_gather_single", "all_gather_into_tensor"),
        "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    }.items():
        for name in names:
            real = getattr(dist, name, None)
            if real is None:
                continue

            def spy(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
                counts[_kind] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, spy)
    return counts


def _every_schedule(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fastpipe.distributed_pipe import DistributedPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    mine = slice(8 * mesh.get_local_rank("dp"), 8 * mesh.get_local_rank("dp") + 8)
    counts = counting_collectives()
    problems: list[str] = []
    per_step: dict[str, list[dict[str, int]]] = {}
    units: dict[str, int] = {}
    sharded: dict[str, bool] = {}
    for name, balance, p2p in RUNS:
        run = f"{name} ({p2p})"
        pipe = DistributedPipe(
            make_model(), balance, chunks=CHUNKS, schedule=name, mesh=mesh, dp_shard="fsdp", p2p=p2p, timeout=20
        )
        plain = make_model()
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
        ref = dict(plain.named_parameters())
        per_step[run] = []
        units[run] = sum(balance[s] for s in pipe.stages)  # each layer holds parameters: one unit each
        for step in range(2):  # the second step gathers the weights the optimizer stepped
            x, y = batch(step)
            before = dict(counts)
            loss = pipe.train_step(x[mine] if pipe.is_first else None, y[mine] if pipe.is_last else None, nn.MSELoss())
            per_step[run].append({k: counts[k] - before[k] for k in counts})
            expected = nn.MSELoss()(plain(x), y)
            expected.backward()
            if not close_reordered(loss, expected.detach(), k=K):
                problems.append(f"{run} step {step}: loss {loss.item()} != one process's {expected.item()}")
            for n, p in pipe.named_parameters():
                if not close_reordered(p.grad.full_tensor(), ref[n].grad, k=K):
                    problems.append(f"{run} step {step}: the gradient of {n} is not one process's")
            opt.step()
            plain_opt.step()
            opt.zero_grad()
            plain_opt.zero_grad()
        for n, p in pipe.named_parameters():
            if not close_reordered(p.detach().full_tensor(), ref[n].detach(), k=K):
                problems.append(f"{run}: the weight {n} after two steps is not one process's")
        held = [*pipe.parameters(), *pipe.state_dict().values()]  # (the gradients: full_tensor() above)
        sharded[run] = all(isinstance(t, DTensor) and t.to_local().numel() * 2 == t.numel() for t in held)
        pipe.close()
    return {"problems": problems, "per_step": per_step, "units": units, "sharded": sharded}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return check_ok(run_ranks(_every_schedule, 4, timeout=120))


def test_every_schedule_matches_one_process_on_the_whole_batch(ranks: list[dict[str, Any]]) -> None:
    for rank, outcome in enumerate(ranks):
        assert not outcome["problems"], f"rank {rank}: " + "\n".join(outcome["problems"])


def test_parameters_and_state_dict_hold_half_of_each_tensor_between_steps(ranks: list[dict[str, Any]]) -> None:
    for rank, outcome in enumerate(ranks):
        assert all(outcome["sharded"].values()), f"rank {rank}: {outcome['sharded']}"


def test_each_unit_gathers_and_reduce_scatters_once_per_step(ranks: list[dict[str, Any]]) -> None:
    # The stage roots hold no parameters of their own: no collective of theirs.
    for rank, outcome in enumerate(ranks):
        for run, steps in outcome["per_step"].items():
            for counts in steps:
                want = {"all_gather": outcome["units"][run], "reduce_scatter": outcome["units"][run]}
                assert counts == want, f"rank {rank}, {run}: {counts} per step with {CHUNKS} micro-batches"
