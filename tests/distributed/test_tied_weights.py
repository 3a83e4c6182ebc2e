"""A tensor used by stages on different ranks (a tied embedding) behaves as in the plain model.

Each rank that uses it trains a copy of its own; the properties to protect are the plain
model's: the loss and the gradient summed over every use, copies that stay bitwise equal
over optimizer steps, the Sequential's keys in each rank's ``state_dict`` and a checkpoint
that loads into the tied Sequential.
"""

from __future__ import annotations

import copy

import torch
from _dist_utils import check_ok, run_ranks
from _tied_gpt import DIM, VOCAB, K, TokenCE, gpt
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe

# 2 stages: both ties cross the ranks. Interleaved, stages 1 and 3 are rank 1's: the block's
# tie stays on it, the embedding's crosses from stage 0 (rank 0) to stage 3.
LAYOUTS = {"gpipe": [4, 6], "1f1b": [4, 6], "zb-h1": [4, 6], "interleaved": [1, 3, 3, 3]}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (8, 4), generator=g), torch.randint(0, VOCAB, (8, 4), generator=g)


def _step(pipe, step: int) -> torch.Tensor:
    ids, y = batch(step)
    return pipe.train_step(ids if pipe.is_first else None, y if pipe.is_last else None, TokenCE())


def _every_schedule(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    out = {}
    for name, balance in LAYOUTS.items():
        pipe = DistributedPipe(gpt(), balance, chunks=4, schedule=name, timeout=20)
        loss = _step(pipe, 0)
        out[name] = {
            "loss": loss,
            "grads": {n: p.grad for n, p in pipe.named_parameters()},
            "keys": list(pipe.state_dict()),
            "ties": [(t.name, t.reader_name, t.owner_stage, t.reader_stage, t.ranks) for t in pipe.ties],
        }
        pipe.close()
    return out


def test_loss_and_gradients_equal_the_plain_model_under_every_schedule(transport: str) -> None:
    ranks = check_ok(run_ranks(_every_schedule, 2, timeout=90))
    ref = gpt()
    ids, y = batch(0)
    loss_ref = TokenCE()(ref(ids), y)
    loss_ref.backward()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for name in LAYOUTS:
        first, last = ranks[0][name], ranks[1][name]
        for outcome in (first, last):
            assert_close_reordered(outcome["loss"], loss_ref.detach(), k=K, msg=name)
            for n, g in outcome["grads"].items():  # a tied copy's: the sum over every use
                assert_close_reordered(g, grads[n], k=K, msg=f"{name}: {n}")
        assert first["ties"] == last["ties"]
    two = ["0.wte.weight", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert ranks[0]["1f1b"]["keys"] == two
    assert ranks[1]["1f1b"]["keys"] == ["5.weight", "5.bias", "7.weight", "7.bias", "8.weight", "8.bias", "9.weight"]
    assert ranks[0]["1f1b"]["ties"] == [
        ("3.weight", "7.weight", 0, 1, (0, 1)),
        ("3.bias", "7.bias", 0, 1, (0, 1)),
        ("0.wte.weight", "9.weight", 0, 1, (0, 1)),
    ]
    assert ranks[0]["interleaved"]["keys"] == ["0.wte.weight", "5.weight", "5.bias"]
    assert ranks[1]["interleaved"]["keys"] == [
        *("1.weight", "1.bias", "3.weight", "3.bias", "7.weight", "7.bias", "8.weight", "8.bias", "9.weight")
    ]
    # One parameter for the block's two uses on rank 1, as in the plain model.
    assert list(ranks[1]["interleaved"]["grads"]) == [
        "1.weight",
        "1.bias",
        "3.weight",
        "3.bias",
        "8.weight",
        "8.bias",
        "9.weight",
    ]
    assert ranks[0]["interleaved"]["ties"] == [
        ("3.weight", "7.weight", 1, 3, (1,)),
        ("3.bias", "7.bias", 1, 3, (1,)),
        ("0.wte.weight", "9.weight", 0, 3, (0, 1)),
    ]


def _adam(rank: int, world: int, path: str) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    out: dict = {}
    for name, balance in [("1f1b", LAYOUTS["1f1b"]), ("interleaved", LAYOUTS["interleaved"])]:
        pipe = DistributedPipe(gpt(), balance, chunks=4, schedule=name, timeout=20)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        for step in range(5):
            opt.zero_grad()
            _step(pipe, step)
            opt.step()
        out[name] = {n: p.detach().clone() for n, p in pipe.state_dict().items()}
        if name == "1f1b":
            fastpipe.save(pipe, path)
            try:
                pipe.fit([], TokenCE(), opt, consistency="sync")
            except ValueError as exc:
                out["fit"] = str(exc)
        pipe.close()
    return out


def test_copies_stay_bitwise_equal_over_adam_steps_and_save_as_the_tied_sequential(tmp_path) -> None:
    path = str(tmp_path / "tied.pt")
    first, last = check_ok(run_ranks(_adam, 2, path, timeout=90))
    for name in ("1f1b", "interleaved"):
        ref = gpt()
        opt = torch.optim.Adam(ref.parameters(), lr=0.05)
        for step in range(5):
            ids, y = batch(step)
            opt.zero_grad()
            TokenCE()(ref(ids), y).backward()
            opt.step()
        mine = {**first[name], **last[name]}
        for n, value in ref.state_dict().items():
            assert_close_reordered(mine[n], value, k=4096, msg=f"{name}: {n}")
    # Each rank steps its own copy with the same summed gradient: the copies never drift.
    assert torch.equal(first["1f1b"]["0.wte.weight"], last["1f1b"]["9.weight"])
    assert torch.equal(first["1f1b"]["3.weight"], last["1f1b"]["7.weight"])
    assert torch.equal(first["interleaved"]["0.wte.weight"], last["interleaved"]["9.weight"])
    assert torch.equal(last["interleaved"]["3.weight"], last["interleaved"]["7.weight"])
    plain = gpt(seed=1)
    fastpipe.load(path, plain)
    assert plain[9].weight is plain[0].wte.weight and plain[7] is plain[3]
    for n, value in plain.state_dict().items():
        assert torch.equal(value, {**first["1f1b"], **last["1f1b"]}[n]), n
    for rank in (first, last):  # fit steps each stage apart: it would break the tie
        assert "cannot keep '3.weight' (stage 0) and its use '7.weight' (stage 1) tied" in rank["fit"]


def untied_stage(s: int, balance: list[int]) -> nn.Sequential:
    """Stage ``s`` of gpt() built alone: its tied tensors are its own, and hold other values."""
    start = sum(balance[:s])
    part = copy.deepcopy(nn.Sequential(*list(gpt())[start : start + balance[s]]))
    if s > 0:
        with torch.no_grad():
            for p in [*part[3].parameters(), part[5].weight]:  # layers 7 and 9: the uses of 3 and 0
                p.normal_()  # the tie's broadcast must overwrite the reader's values
    return part


def _declared(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    balance = LAYOUTS["1f1b"]
    ties = [("0.wte.weight", "9.weight"), ("3.weight", "7.weight"), ("3.bias", "7.bias")]
    built = DistributedPipe.from_stage_builder(lambda s: untied_stage(s, balance), balance, ties=ties, chunks=4)
    whole = DistributedPipe(gpt(), balance, chunks=4, timeout=20)
    pipes = [built, whole]
    opts = [torch.optim.Adam(p.parameters(), lr=0.05) for p in pipes]
    for step in range(3):
        for pipe, opt in zip(pipes, opts):
            opt.zero_grad()
            _step(pipe, step)
            opt.step()
    out: dict = {name: dict(p.state_dict()) for name, p in zip(["built", "whole"], pipes)}
    for case, wrong in {"missing": [("0.wte.weight", "9.weights")], "shape": [("0.wte.weight", "5.weight")]}.items():
        try:
            DistributedPipe.from_stage_builder(lambda s: untied_stage(s, balance), balance, ties=wrong, timeout=20)
        except ValueError as exc:
            out[case] = str(exc)
    return out


def test_declared_ties_of_stages_built_apart_train_as_the_ties_of_the_whole_model() -> None:
    for rank in check_ok(run_ranks(_declared, 2, timeout=60)):
        assert rank["built"].keys() == rank["whole"].keys()
        for n, value in rank["built"].items():  # the reader's own values were overwritten at construction
            assert torch.equal(value, rank["whole"][n]), n
        # Names that no rank holds, or uses that disagree, are refused on every rank at once.
        assert "tie ('0.wte.weight', '9.weights'): no rank's stages hold ['9.weights']" in rank["missing"]
        assert "'0.wte.weight' on rank 0: parameter float32 (11, 6)" in rank["shape"]
        assert "'5.weight' on rank 1: parameter float32 (6, 6)" in rank["shape"]


def gpt4(seed: int = 0) -> nn.Sequential:
    """gpt() whose block is used on 3 stages of [2, 3, 2, 3]: a group of ranks {0, 2, 3}, and {0, 3} for the head."""
    return gpt(seed, block_at=(1, 5, 7))


def _four_ranks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe

    out: dict = {}
    pipe = DistributedPipe(gpt4(), [2, 3, 2, 3], chunks=4, timeout=20)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        _step(pipe, step)
        opt.step()
    out["pp4"] = dict(pipe.state_dict())
    out["groups"] = [g.ranks for g in pipe.ties.groups]
    pipe.close()
    # 2 pipeline ranks x 2 replicas: each replica's ranks tie their own copies.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    pipe = DistributedPipe(gpt(), LAYOUTS["1f1b"], chunks=2, mesh=mesh, timeout=20)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
    for step in range(3):
        ids, y = batch(step)
        opt.zero_grad()
        pipe.train_step(ids[half] if pipe.is_first else None, y[half] if pipe.is_last else None, TokenCE())
        opt.step()
    out["pp2dp2"] = dict(pipe.state_dict())
    out["dp_groups"] = [g.ranks for g in pipe.ties.groups]
    pipe.close()
    return out


def _trained(build, steps: int = 3) -> dict:
    ref = build()
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(steps):
        ids, y = batch(step)
        opt.zero_grad()
        TokenCE()(ref(ids), y).backward()
        opt.step()
    return ref.state_dict()


def test_ties_over_three_of_four_ranks_and_per_data_parallel_replica() -> None:
    ranks = check_ok(run_ranks(_four_ranks, 4, timeout=120))
    # gloo's all-reduce hands every member the same bits, also over 3 ranks.
    assert [r["groups"] for r in ranks] == [[(0, 2, 3), (0, 3)], [], [(0, 2, 3)], [(0, 2, 3), (0, 3)]]
    block = [ranks[0]["pp4"]["1.weight"], ranks[2]["pp4"]["5.weight"], ranks[3]["pp4"]["7.weight"]]
    assert all(torch.equal(b, block[0]) for b in block)
    assert torch.equal(ranks[0]["pp4"]["0.wte.weight"], ranks[3]["pp4"]["9.weight"])
    mine = {k: v for r in ranks for k, v in r["pp4"].items()}
    for n, value in _trained(gpt4).items():
        assert_close_reordered(mine[n], value, k=4096, msg=n)
    # The mesh's pipelines are ranks {0, 2} and {1, 3}: one tie group in each.
    assert [r["dp_groups"] for r in ranks] == [[(0, 2)], [(1, 3)], [(0, 2)], [(1, 3)]]
    for n, value in _trained(gpt).items():
        copies = [r["pp2dp2"][m] for r in ranks for m in (n, TIED.get(n)) if m in r["pp2dp2"]]
        assert len(copies) == 2 + 2 * (n in TIED), n  # one per replica, and the tie's copies
        assert all(torch.equal(c, copies[0]) for c in copies), n
        assert_close_reordered(copies[0], value, k=4096, msg=n)


TIED = {"0.wte.weight": "9.weight", "3.weight": "7.weight", "3.bias": "7.bias"}


class PoisonedCE(TokenCE):
    """TokenCE whose loss is NaN while ``poisoned`` (set on every rank; only the last one runs it)."""

    poisoned = False

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = super().forward(logits, target)
        return loss * float("nan") if self.poisoned else loss


def _skipped(rank: int, world: int) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fastpipe.distributed_pipe import DistributedPipe

    runs = {}
    for name in ("clean", "skip", "scaler"):
        pipe = DistributedPipe(gpt(), LAYOUTS["1f1b"], chunks=4, on_nan="skip", timeout=20)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**12) if name == "scaler" else None
        loss_fn = PoisonedCE()
        for step in [0, 1, 2] if name == "clean" else [0, None, 1, 2]:  # None: a step whose loss is NaN
            loss_fn.poisoned = step is None
            ids, y = batch(step or 0)
            opt.zero_grad()
            pipe.train_step(ids if pipe.is_first else None, y if pipe.is_last else None, loss_fn, scaler=scaler)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        runs[name] = dict(pipe.state_dict())
        pipe.close()
    return runs


def test_a_skipped_step_keeps_the_tie_groups_in_step_with_on_nan_and_a_grad_scaler() -> None:
    first, last = check_ok(run_ranks(_skipped, 2, timeout=90))
    for rank in (first, last):
        for name in ("skip", "scaler"):  # a scale that is a power of 2 unscales exactly
            for n, value in rank[name].items():
                assert torch.equal(value, rank["clean"][n]), (name, n)
    for name in ("clean", "skip", "scaler"):
        for owner, reader in TIED.items():
            assert torch.equal(first[name][owner], last[name][reader]), (name, owner)


class Rotary(nn.Module):
    """Constant buffers only, like a rotary embedding shared by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Rotated(nn.Module):
    def __init__(self, rotary: Rotary) -> None:
        super().__init__()
        self.rotary = rotary
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.rotary(x)))


def rotated(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    rotary = Rotary()
    return nn.Sequential(*[Rotated(rotary) for _ in range(4)])


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)


def _buffers(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    x, y = inputs()
    pipe = DistributedPipe(rotated(), [2, 2], chunks=2, timeout=20)
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    out: dict = {"loss": loss, "grads": {n: p.grad for n, p in pipe.named_parameters()}, "ties": list(pipe.ties)}
    norm = nn.BatchNorm1d(DIM)
    pipe = DistributedPipe(nn.Sequential(norm, nn.Linear(DIM, DIM), norm), [2, 1], timeout=20)
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["written"] = (type(exc).__name__, str(exc))
    return out


def test_a_module_of_constant_buffers_is_replicated_across_ranks_and_a_written_one_refused() -> None:
    ranks = check_ok(run_ranks(_buffers, 2, timeout=60))
    ref = rotated()
    x, y = inputs()
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for rank in ranks:
        assert [(t.name, t.reader_name, t.ranks) for t in rank["ties"]] == [
            ("0.rotary.scale", "2.rotary.scale", (0, 1))
        ]
        assert_close_reordered(rank["loss"], loss_ref.detach(), k=K)
        for n, g in rank["grads"].items():
            assert_close_reordered(g, grads[n], k=K, msg=n)
        kind, message = rank["written"]
        assert kind in ("RuntimeError", "PipelineError") and "wrote into buffer '" in message, message
        assert "must stay constant" in message
