"""What a pipe sharded over its replicas (``dp_shard="fsdp"``, 4 gloo ranks) holds, keeps and refuses.

Tied weights (across ranks and within one) and skips give one process's numbers; a rank holds
about half the parameter, gradient and Adam bytes of a replicated pipe; bad meshes and settings
fail at once, on every rank. One spawn of the 4 ranks serves every test of the module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _tied_gpt import VOCAB, K, TokenCE
from _tied_gpt import gpt as tied_gpt
from fp_tolerance import close_reordered
from torch import nn

import fastpipe


def gpt() -> nn.Sequential:
    """The tied GPT with one Linear used at 3 and 7, and layer 5's weight layer 1's."""
    return tied_gpt(shared=(1, 5))


# 1f1b: both ties cross the ranks. zb-v: stages 0 and 3 are rank 0's, so the embedding's tie to
# the head stays on it. interleaved: the block's tie stays on rank 1 (stages 1 and 3). gpipe:
# layers 1 and 5, two modules of one stage, share a weight, so that stage's root unit holds it.
TIED = [("1f1b", [4, 6]), ("zb-v", [1, 3, 3, 3]), ("interleaved", [1, 3, 3, 3]), ("gpipe", [8, 2])]


def unet() -> fastpipe.Sequential:
    """Skips 'a' (stage 0 to 1) and 'b' (within stage 1)."""
    torch.manual_seed(0)
    return fastpipe.Sequential(
        nn.Linear(6, 8),
        fastpipe.stash("a"),
        nn.Linear(8, 8),
        nn.Tanh(),
        fastpipe.stash("b"),
        nn.Linear(8, 8),
        fastpipe.pops(Join("b"), "b"),
        fastpipe.pops(Join("a"), "a"),
    )


class Join(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, **skips: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(torch.cat([x, skips[self.name]], dim=1)))


def _check_against_plain(pipe: Any, plain: nn.Module, loss: torch.Tensor, expected: torch.Tensor, what: str) -> list:
    problems = []
    if not close_reordered(loss, expected.detach(), k=K):
        problems.append(f"{what}: loss {loss.item()} != one process's {expected.item()}")
    ref = dict(plain.named_parameters(remove_duplicate=False))
    for n, p in pipe.named_parameters():  # a tied weight's: the sum over every use
        if not close_reordered(p.grad.full_tensor(), ref[n].grad, k=K):
            problems.append(f"{what}: the gradient of {n} is not one process's")
    return problems


def _ties_and_skips(mesh: Any, d: int) -> list[str]:
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    for name, balance in TIED:
        pipe = DistributedPipe(gpt(), balance, chunks=4, schedule=name, mesh=mesh, dp_shard="fsdp", timeout=20)
        plain = gpt()
        opt, plain_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(plain.parameters(), lr=0.5)
        for step in range(2):  # the second step runs on the copies the first step's update refreshed
            g = torch.Generator().manual_seed(step)
            ids, y = torch.randint(0, VOCAB, (16, 4), generator=g), torch.randint(0, VOCAB, (16, 4), generator=g)
            mine = slice(8 * d, 8 * d + 8)
            loss = pipe.train_step(ids[mine] if pipe.is_first else None, y[mine] if pipe.is_last else None, TokenCE())
            expected = TokenCE()(plain(ids), y)
            expected.backward()
            problems += _check_against_plain(pipe, plain, loss, expected, f"{name} step {step}")
            for o in (opt, plain_opt):
                o.step()
                o.zero_grad()
        pipe.ties.sync()  # the owners' shards to the other uses' ranks: equal already, so nothing moves
        for n, p in dict(plain.named_parameters(remove_duplicate=False)).items():
            mine = dict(pipe.named_parameters()).get(n)
            if mine is not None and not close_reordered(mine.detach().full_tensor(), p.detach(), k=K):
                problems.append(f"{name}: the weight {n} after two steps and ties.sync() is not one process's")
        pipe.close()
    for name, balance in {"1f1b": [3, 5], "zb-h1": [3, 5]}.items():
        pipe = DistributedPipe(unet(), balance, chunks=4, schedule=name, mesh=mesh, dp_shard="fsdp", timeout=20)
        plain = unet()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 8, generator=g)
        loss = pipe.train_step(x[8 * d : 8 * d + 8] if pipe.is_first else None, y[8 * d : 8 * d + 8], nn.MSELoss())
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        problems += _check_against_plain(pipe, plain, loss, expected, f"skips, {name}")
        pipe.close()
    return problems


def _state_bytes(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from fastpipe.distributed_pipe import DistributedPipe

    out: dict[str, Any] = {}
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    for dp_shard in ("replicate", "fsdp"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 63))  # 63 rows: uneven shards
        pipe = DistributedPipe(model, [2, 3], chunks=2, mesh=mesh, dp_shard=dp_shard, timeout=20)
        opt = torch.optim.Adam(pipe.parameters())
        pipe.train_step(x, y[:, :63], nn.MSELoss())
        opt.step()
        out[dp_shard] = pipe.state_bytes(opt)
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        out[f"{dp_shard} optimizer DTensors"] = all(isinstance(v, DTensor) for v in states)
        pipe.close()
    return out


def _bad_input(rank: int) -> dict[str, Any]:
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe
    from fastpipe.errors import PipelineError

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])

    out: dict[str, Any] = {}
    meshes = {
        "no dp": init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)),
        "dp first": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")),
    }
    for what, bad in meshes.items():
        try:
            DistributedPipe(model(), [2, 2], mesh=bad, dp_shard="fsdp", timeout=20)
        except ValueError as exc:
            out[what] = str(exc)
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    try:
        DistributedPipe(model(), [2, 2], mesh=pp_dp, dp_shard="zero", timeout=20)
    except ValueError as exc:
        out["choice"] = str(exc)
    # One replica: fsdp shards nothing, and trains exactly as replicate does.
    one = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    losses = {}
    for dp_shard in ("replicate", "fsdp"):
        pipe = DistributedPipe(model(), [1, 1, 1, 1], chunks=2, mesh=one, dp_shard=dp_shard, timeout=20)
        losses[dp_shard] = pipe.train_step(x, y, nn.MSELoss())
        out[f"{dp_shard} grads"] = [p.grad for p in pipe.parameters()]
        out[f"{dp_shard} plain"] = all(type(p) is nn.Parameter for p in pipe.parameters())
        pipe.close()
    out["losses"] = losses
    # The replica of ranks 1 and 3 asks for replicas: the data-parallel check fails on every rank.
    # Then rank 3 alone: its pipeline (ranks 1, 3) fails the pipeline check, and the other
    # pipeline's ranks, left waiting for theirs at the data-parallel check, fail at the timeout.
    for what, odd in (("replica", rank in (1, 3)), ("rank", rank == 3)):
        start = time.monotonic()
        try:
            DistributedPipe(model(), [2, 2], mesh=pp_dp, dp_shard="replicate" if odd else "fsdp", timeout=3)
        except (ValueError, PipelineError) as exc:
            out[f"{what} disagrees"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


def _hung_replica(rank: int) -> tuple[str, str, float]:
    """Rank 1 (stage 0's replica of rank 0) never starts the step: rank 0 waits in the FSDP all-gather."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    pipe = DistributedPipe(model, [2, 2], chunks=2, mesh=mesh, dp_shard="fsdp", timeout=3, first_step_timeout=3)
    start = time.monotonic()
    if rank == 1:
        time.sleep(6)
        return "slept", "", time.monotonic() - start
    try:
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "trained", "", time.monotonic() - start


def _everything(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out: dict[str, Any] = {"problems": _ties_and_skips(mesh, mesh.get_local_rank("dp"))}
    out["bytes"] = _state_bytes(mesh)
    out["bad"] = _bad_input(rank)
    out["hung"] = _hung_replica(rank)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return check_ok(run_ranks(_everything, 4, timeout=120))


def test_tied_weights_and_skips_give_one_process_numbers(ranks: list[dict[str, Any]]) -> None:
    for rank, outcome in enumerate(ranks):
        assert not outcome["problems"], f"rank {rank}: " + "\n".join(outcome["problems"])


def test_a_rank_holds_about_half_the_replicated_parameter_gradient_and_adam_bytes(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, outcome in enumerate(ranks):
        got = outcome["bytes"]
        total = {k: sum(got[k].values()) for k in ("replicate", "fsdp")}
        assert total["fsdp"] <= 0.55 * total["replicate"], f"rank {rank}: {got}"
        assert all(got["fsdp"][k] > 0 for k in ("parameters", "gradients", "optimizer")), got
        assert got["fsdp optimizer DTensors"] and not got["replicate optimizer DTensors"]


def test_a_mesh_without_dp_or_in_another_order_names_the_expected_dimensions(
    ranks: list[dict[str, Any]],
) -> None:
    for outcome in ranks:
        for what in ("no dp", "dp first"):
            assert "('pp', 'dp')" in outcome["bad"][what], outcome["bad"]


def test_an_unknown_dp_shard_lists_the_choices(ranks: list[dict[str, Any]]) -> None:
    for outcome in ranks:
        message = outcome["bad"]["choice"]
        assert "'replicate'" in message and "'fsdp'" in message and "'zero'" in message


def test_fsdp_over_one_replica_trains_as_replicate(ranks: list[dict[str, Any]]) -> None:
    for outcome in ranks:
        bad = outcome["bad"]
        assert bad["fsdp plain"] and bad["replicate plain"]
        assert torch.equal(bad["losses"]["fsdp"], bad["losses"]["replicate"])
        for a, b in zip(bad["fsdp grads"], bad["replicate grads"]):
            assert torch.equal(a, b)


def test_ranks_that_disagree_on_dp_shard_raise_as_for_other_settings(ranks: list[dict[str, Any]]) -> None:
    for rank, outcome in enumerate(ranks):
        kind, message, elapsed = outcome["bad"]["replica disagrees"]
        assert kind == "ValueError" and "data-parallel ranks disagree on dp_shard" in message, message
        assert elapsed < 3.0
        kind, message, elapsed = outcome["bad"]["rank disagrees"]
        if rank in (1, 3):
            assert kind == "ValueError" and "pipeline ranks disagree on dp_shard" in message, message
            assert "rank 3: 'replicate'" in message
        else:
            assert kind == "PipelineError" and "data-parallel ranks' settings" in message, message
        assert elapsed < 3.0 + 5.0


def test_a_replica_that_never_starts_the_step_fails_it_on_every_rank_within_the_timeout(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, outcome in enumerate(ranks):
        kind, message, elapsed = outcome["hung"]
        if rank == 1:
            continue
        assert kind == "PipelineError", f"rank {rank}: {kind} {message}"
        assert elapsed < 3.0 + 5.0, f"rank {rank}: {elapsed:.1f} s"
    # Rank 0 either times out in its own all-gather with rank 1 or, when rank 3's wait for the step
    # values expires first, fails with rank 3's diagnosis through the abort key: both name the hang.
    message = ranks[0]["hung"][1]
    assert "FSDP all-gather" in message or "did not deliver" in message, ranks[0]["hung"]
