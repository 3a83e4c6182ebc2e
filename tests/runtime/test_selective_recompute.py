"""Per-layer recompute (``checkpoint=`` a predicate, ``"attention"``, ``"mlp"``) changes memory, never gradients.

The property: a pipe that recomputes chosen layers or parts of blocks in the backward gives the
loss and gradients of the same pipe with ``checkpoint="never"``, bit for bit (the recompute runs
the same ops on the same tensors), dropout and SDPA included, under every schedule family; each
region runs once more per backward, and only in training.
"""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe, pops, stash
from fastpipe.runtime.selective import regions_of
from fastpipe.step.recompute_policy import Recompute

D = 16


class Conv1D(nn.Module):
    """GPT-2's projection: a weight that autograd, not fastpipe's Linear path, gives its gradient."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Block(nn.Module):
    """A transformer-like block with named parts, dropout in both, and a matrix parameter outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.3))
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Dropout(0.2), Conv1D(4 * D, D))
        self.out = nn.Parameter(torch.randn(D, D) / D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x) @ self.out

    def fastpipe_parts(self) -> dict[str, nn.Module]:
        return {"attention": self.attn, "mlp": self.mlp}


def blocks(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, D, generator=g), torch.randn(16, D, generator=g)


def even_layers(index: int, layer: nn.Module) -> bool:
    return index % 2 == 0


SCHEDULES = [("gpipe", [2, 2], 1), ("1f1b", [2, 2], 1), ("zb-h1", [2, 2], 1), ("zb-v", [1, 1, 1, 1], 2)]


def step(model: nn.Sequential, checkpoint: object, schedule: str, balance: list[int], v: int) -> list[torch.Tensor]:
    pipe = Pipe(model, balance, chunks=4, checkpoint=checkpoint, schedule=schedule, virtual_stages=v)  # type: ignore[arg-type]
    try:
        torch.manual_seed(7)  # the step's seed: the same dropout masks for every policy
        loss = pipe.train_step(*data(), nn.MSELoss())
        return [loss, *(p.grad for p in pipe.parameters())]  # type: ignore[list-item]
    finally:
        pipe.close()


@pytest.mark.parametrize(("schedule", "balance", "v"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("policy", ["mlp", ["attention", "mlp"], even_layers], ids=["mlp", "both", "predicate"])
def test_gradients_equal_the_pipe_that_keeps_everything_bit_for_bit(
    schedule: str, balance: list[int], v: int, policy: object
) -> None:
    kept = step(blocks(), "never", schedule, balance, v)
    recomputed = step(blocks(), policy, schedule, balance, v)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_the_pipe_equals_the_plain_model_without_dropout() -> None:
    model, plain = blocks(), blocks()
    for m in [*model.modules(), *plain.modules()]:
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    x, y = data()
    nn.MSELoss()(plain(x), y).backward()
    got = step(model, "mlp", "zb-h1", [2, 2], 1)[1:]
    for g, p in zip(got, plain.parameters()):
        assert_close_reordered(g, p.grad, k=8 * D)


def test_forward_and_backward_through_autograd_equal_too() -> None:
    grads = []
    for policy in ("never", ["attention"]):
        pipe = Pipe(blocks(), [2, 2], chunks=4, checkpoint=policy)  # type: ignore[arg-type]
        x, y = data()
        torch.manual_seed(3)
        nn.MSELoss()(pipe(x), y).backward()
        grads.append([p.grad for p in pipe.parameters()])
        pipe.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _count_calls(model: nn.Sequential) -> list[int]:
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    for block in model:
        block.mlp[1].register_forward_hook(hook)  # inside the region: the recompute runs it again
    return calls


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_region_runs_once_in_the_forward_and_once_in_the_backward(schedule: str) -> None:
    # zb-h1 splits the backward: a region parameter left to W would need the region's saved
    # tensors again in W, a second recompute. B takes them (fastpipe.runtime.selective).
    for policy, per_microbatch in (("never", 1), ("mlp", 2)):
        model = blocks()
        calls = _count_calls(model)
        step(model, policy, schedule, [2, 2], 1)
        assert calls[0] == 4 * len(model) * per_microbatch, policy


def test_fit_refuses_a_per_layer_policy_and_runs_auto_as_never() -> None:
    model = blocks()
    calls = _count_calls(model)
    pipe = Pipe(model, [2, 2], chunks=4, checkpoint="mlp")
    try:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="fit recomputes whole stages only.*set pipe.checkpoint to 'never'"):
            list(pipe.fit([data()], nn.MSELoss(), opt, consistency="sync", window=1))
        assert calls[0] == 0
        pipe.checkpoint = "auto"  # type: ignore[assignment]
        list(pipe.fit([data()], nn.MSELoss(), opt, consistency="sync", window=1))
    finally:
        pipe.close()
    assert calls[0] == 4 * len(model)


def test_no_recompute_without_a_graph_or_in_eval() -> None:
    model = blocks()
    calls = _count_calls(model)
    pipe = Pipe(model, [2, 2], chunks=4, checkpoint="mlp")
    x, _ = data()
    with torch.no_grad():
        pipe(x)
    pipe.eval()
    pipe(x).sum().backward()
    pipe.close()
    assert calls[0] == 2 * 4 * len(model)


class PositionalBlock(nn.Module):
    """A block whose MLP reads a parameter, not the stage's input: only W needs its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, D))
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.pos).sum(0)

    def fastpipe_parts(self) -> dict[str, nn.Module]:
        return {"mlp": self.mlp}


def test_a_linear_recomputed_inside_w_routes_as_in_its_forward() -> None:
    # The region's Linears deferred their weight work in the forward (DeferringLinear); its
    # recompute runs inside W, where no routing is installed, and must save what the forward saved.
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(PositionalBlock(), PositionalBlock())

    kept = step(model(), "never", "zb-h1", [1, 1], 1)
    recomputed = step(model(), "mlp", "zb-h1", [1, 1], 1)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_running_statistics_are_updated_once() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, D))

    stats = []
    for policy in ("never", lambda i, layer: isinstance(layer, nn.BatchNorm1d)):
        pipe = Pipe(model(), [2, 1], chunks=4, checkpoint=policy)  # type: ignore[arg-type]
        pipe.train_step(*data(), nn.MSELoss())
        stats.append(pipe[1].running_mean.clone())  # type: ignore[union-attr]
        pipe.close()
    assert torch.equal(*stats)


def test_the_checkpoint_set_between_steps_is_the_one_that_runs() -> None:
    model = blocks()
    calls = _count_calls(model)
    pipe = Pipe(model, [2, 2], chunks=4, checkpoint="mlp")
    try:
        assert all(regions_of(s) for s in pipe.partitions)
        pipe.checkpoint = "never"  # type: ignore[assignment]
        pipe.train_step(*data(), nn.MSELoss())
        assert calls[0] == 4 * len(model) and not any(regions_of(s) for s in pipe.partitions)
        assert pipe.checkpoint_chosen == "never"
        pipe.checkpoint = "mlp"  # type: ignore[assignment]
        pipe.train_step(*data(), nn.MSELoss())
        assert calls[0] == 3 * 4 * len(model)
        assert str(pipe.checkpoint_chosen) == "mlp"
    finally:
        pipe.close()


@pytest.mark.parametrize(
    "bad", ["mlpp", "Always", 3, ["mlp", "mlp"], ["mlp", 3], [], nn.Linear(2, 2), None], ids=lambda b: repr(b)[:16]
)
def test_a_malformed_checkpoint_is_refused_naming_the_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError, match="'always', 'except_last', 'never'|names a part twice"):
        Pipe(blocks(), [2, 2], chunks=4, checkpoint=bad)  # type: ignore[arg-type]


def test_a_part_the_model_lacks_is_refused_naming_the_parts_it_has() -> None:
    class MlpOnly(Block):
        def fastpipe_parts(self) -> dict[str, nn.Module]:
            return {"mlp": self.mlp}

    model = nn.Sequential(MlpOnly(), MlpOnly())
    with pytest.raises(ValueError, match=r"checkpoint='attention' matches no part .* 'mlp' \(2 layers\)"):
        Pipe(model, [1, 1], chunks=2, checkpoint="attention")
    plain = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    with pytest.raises(ValueError, match="no layer of this model names its parts.*fastpipe_parts"):
        Pipe(plain, [1, 1], chunks=2, checkpoint=["mlp"])


def test_a_predicate_must_answer_with_a_bool() -> None:
    with pytest.raises(ValueError, match="returned 1 for layer 0 .*True .* or False"):
        Pipe(blocks(), [2, 2], chunks=4, checkpoint=lambda i, layer: 1)  # type: ignore[arg-type,return-value]


class Add(nn.Module):
    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + h


def test_a_layer_that_stashes_a_skip_is_not_recomputed_alone() -> None:
    model = nn.Sequential(nn.Linear(D, D), stash("h"), pops(Add(), "h"))
    with pytest.raises(ValueError, match="stashes a skip"):
        Pipe(model, [2, 1], chunks=2, checkpoint=lambda i, layer: i == 1)


def test_recompute_names_itself() -> None:
    assert str(Recompute(parts=("attention", "mlp"))) == "attention + mlp"
    assert str(Recompute(layers=even_layers)) == "layers even_layers"
    with pytest.raises(ValueError, match="layers= .* or parts="):
        Recompute()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_hf_blocks_recompute_their_parts_with_dropout_and_sdpa_bit_for_bit(attn: str, schedule: str) -> None:
    transformers = pytest.importorskip("transformers")
    from fastpipe.hf import causal_lm_loss, to_sequential

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_implementation=attn,
            use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
        assert cfg.attn_pdrop > 0 and cfg.resid_pdrop > 0
        return to_sequential(transformers.GPT2LMHeadModel(cfg).train())

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    results = []
    for policy in ("never", "attention", "mlp"):
        pipe = Pipe(model(), [3, 2], chunks=4, checkpoint=policy, schedule=schedule)  # type: ignore[arg-type]
        if policy != "never":
            assert [len(regions_of(s)) for s in pipe.partitions] == [2, 0]
        torch.manual_seed(5)
        loss = pipe.train_step(ids, ids.masked_fill(mask == 0, -100), causal_lm_loss, attention_mask=mask)
        results.append([loss, *(p.grad for p in pipe.parameters())])
        pipe.close()
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got))
