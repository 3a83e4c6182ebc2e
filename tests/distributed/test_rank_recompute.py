"""``DistributedPipe(checkpoint=<per-layer policy>)`` on two gloo ranks.

A predicate counts layers over the whole model, though each rank holds its own stages; a named
part needs to be some rank's layers', not every rank's; a policy that is wrong on one rank is
refused on both. Recompute replays the same arithmetic, so the gradients are bitwise those
without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss
from torch import nn

H, ROWS, M = 32, 64, 4


class Block(nn.Module):
    """A decoder-like block that names its parts, as fastpipe.hf's blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Sequential(nn.Linear(H, H), nn.Tanh())
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.mlp(x)

    def fastpipe_parts(self) -> dict[str, nn.Module]:
        return {"attention": self.attention, "mlp": self.mlp}


def model(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, H), *[Block() for _ in range(blocks)])


def odd(index: int, layer: nn.Module) -> bool:
    return index % 2 == 1


def recompute_on_ranks(rank: int, world: int) -> dict[str, Any]:
    from fastpipe import DistributedPipe
    from fastpipe.runtime.selective import regions_of

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * ROWS, H, generator=g), torch.randn(M * ROWS, H, generator=g)
    out: dict[str, Any] = {}

    def trained(checkpoint: Any, balance: list[int], limit: Any = None) -> DistributedPipe:
        pipe = DistributedPipe(model(), balance, chunks=M, schedule="1f1b", checkpoint=checkpoint, memory_limit=limit)
        pipe.train_step(x, y, ProductLoss())
        return pipe

    def grads(pipe: DistributedPipe) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in pipe.named_parameters()}

    from fastpipe.step.recompute_policy import Recompute, every_layer

    settings: dict[str, Any] = {"odd": odd, "mlp": "mlp", "nested": Recompute(layers=every_layer, stage="always")}
    for name, balance in (("odd", [2, 2]), ("mlp", [1, 3]), ("nested", [2, 2])):
        plain = trained("never", balance, "1GiB")
        policy = trained(settings[name], balance, "1GiB")
        (stage,) = policy._stages.values()
        layers = list(stage.module.children())
        out[name] = {
            "bitwise": all(torch.equal(a, b) for a, b in zip(grads(plain).values(), grads(policy).values())),
            "regions": [(layers.index(r) if r in layers else type(r).__name__) for r in regions_of(stage.module)],
            "activations": [
                (d.activations, e.activations)
                for d, e in zip(plain.memory_guard.last, policy.memory_guard.last)  # type: ignore[union-attr]
            ],
        }
        plain.close()
        policy.close()

    def wrong_on_rank_1(index: int, layer: nn.Module) -> bool:
        return "yes" if index == 3 else False  # type: ignore[return-value]

    flat = nn.Sequential(*[nn.Linear(H, H) for _ in range(4)])
    for name, args in (("no_parts", (flat, "attention")), ("bad_answer", (model(), wrong_on_rank_1))):
        try:
            DistributedPipe(args[0], [2, 2], chunks=M, checkpoint=args[1])
            out[name] = ""
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)

    # The planner holds a policy given fixed; a lambda does not pickle, so each rank keeps its own.
    planned = DistributedPipe(model(), "auto", chunks=M, checkpoint=lambda i, layer: i == 2, sample=x)
    planned.train_step(x, y, ProductLoss())
    assert planned.plan is not None
    (stage,) = planned._stages.values()
    out["planned"] = (str(planned.plan.chosen.checkpoint), len(regions_of(stage.module)), sum(planned.balance))
    planned.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return check_ok(run_ranks(recompute_on_ranks, 2, timeout=300))


def test_a_predicate_counts_layers_over_the_whole_model_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["odd"] for r in ranks)
    assert first["bitwise"] and second["bitwise"]
    assert first["regions"] == [1] and second["regions"] == [1]  # layers 1 and 3 of the model: odd globally


def test_a_named_part_is_recomputed_where_the_layers_have_it(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["mlp"] for r in ranks)
    assert first["bitwise"] and second["bitwise"]
    assert first["regions"] == [] and second["regions"] == ["Sequential"] * 3  # each block's mlp
    for r in ranks:  # the guard measured the regions: the device holding the blocks keeps less
        plain, policy = r["mlp"]["activations"][1]
        assert policy < plain


def test_layers_recomputed_inside_stage_recompute_keep_the_least_and_the_gradients(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["nested"]["bitwise"] and r["nested"]["regions"] == [0, 1]
        for (plain, nested), (_, odd) in zip(r["nested"]["activations"], r["odd"]["activations"]):
            assert nested < min(odd, plain)


def test_a_policy_wrong_on_one_rank_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "no layer of this model names its parts" in r["no_parts"], r["no_parts"]
        assert "returned 'yes' for layer 3" in r["bad_answer"], r["bad_answer"]


def test_the_planner_holds_a_policy_given_and_each_rank_keeps_its_own(ranks: list[dict[str, Any]]) -> None:
    names = [r["planned"][0] for r in ranks]
    assert names == ["layers <lambda>"] * 2, names
    assert sum(r["planned"][1] for r in ranks) == 1  # layer 2 is one rank's, recomputed there alone
    assert all(r["planned"][2] == 4 for r in ranks)
