"""Property-based transparency: random small models equal the plain model, whatever the split.

hypothesis draws the model (Linear, Conv1d/2d, LayerNorm, BatchNorm with and without
deferral, Dropout, in-place ReLU, Embedding on integer input, tuple-passing layers), the
batch, the balance, the chunks (also more than rows), the schedule and the checkpoint mode.
The pipeline must give the plain model's outputs, input gradients, parameter gradients and
buffers. The plain model runs micro-batch by micro-batch with each (stage, micro-batch)
task seeded as fastpipe seeds it (tests/_seeded_reference), which is how fastpipe defines
dropout's equivalence; so dropout masks must be replayed by every recompute, bit for bit.

fit(consistency="sync") is checked the same way against train_step + optimizer.step().

Everything runs in float64, so rounding (summation order differs: micro-batch gradients
are summed in the schedule's order, the fused Linear backward accumulates in the GEMM)
sits near 1e-15 here, while the bound is about 1e-11 and any real bug (a wrong mask, a
statistic counted twice, a lost micro-batch) moves numbers by far more.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _seeded_reference import seeded_forward, step_seed_after
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe
from fastpipe.model.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from fastpipe.model.partition import first_layer_in_place
from fastpipe.step.microbatch import scatter, tensors_of

DTYPE = torch.float64
# 1e3 × the reduction size (≤ 64 here) × eps: above any rounding, below any real difference.
TOL = {"rtol": 1e3 * 64 * torch.finfo(DTYPE).eps, "atol": 1e3 * 64 * torch.finfo(DTYPE).eps}
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-h2", "zb-v", "dualpipev"]
V_SCHEDULES = ("zb-v", "dualpipev")  # 2 stages per worker, placed in a V
CHECKPOINTS = ["always", "except_last", "never"]
PROFILE = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}


# -- the layers ---------------------------------------------------------------------------


class Fork(nn.Module):
    """Starts a tuple: the value, a second differentiable tensor, and a plain number."""

    def forward(self, x):
        return x, torch.tanh(x), 0.5


class OnFirst(nn.Module):
    """Applies a layer to the first item of a tuple and passes the rest along."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, inp):
        x, *rest = inp
        return (self.layer(x), *rest)


class Merge(nn.Module):
    def forward(self, inp):
        x, side, scale = inp
        return x + scale * side.sum(-1, keepdim=True)


@st.composite
def specs(draw: Any, max_stages: int = 4) -> dict[str, Any]:
    """A model and a run, as plain data (so spawned ranks can rebuild the same model)."""
    front = draw(st.sampled_from(["dense", "tokens", "conv1d", "conv2d"]))
    spec: dict[str, Any] = {"front": front, "seed": draw(st.integers(0, 2**16))}
    spec["channels"] = draw(st.integers(1, 3))
    spec["size"] = draw(st.integers(2, 4))
    spec["front_bn"] = draw(st.booleans())
    spec["body"] = draw(
        st.lists(
            st.sampled_from(["linear", "layernorm", "batchnorm", "dropout", "relu_", "tanh"]), min_size=1, max_size=5
        )
    )
    span = draw(st.one_of(st.none(), st.tuples(st.integers(0, len(spec["body"])), st.integers(0, 2))))
    spec["tuple_span"] = span
    spec["batch"] = draw(st.integers(1, 7))
    spec["chunks"] = draw(st.integers(1, 6))
    spec["deferred"] = draw(st.booleans())
    spec["checkpoint"] = draw(st.sampled_from(CHECKPOINTS))
    spec["schedule"] = draw(st.sampled_from(SCHEDULES))
    layers = len(build(spec)[0])
    stages = draw(st.integers(1, min(max_stages, layers)))
    cuts = (
        sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1)))
        if stages > 1
        else []
    )
    spec["balance"] = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
    return spec


def build(spec: dict[str, Any]) -> tuple[nn.Sequential, torch.Tensor]:
    """The model (float64) and its input, both determined by ``spec``."""
    torch.manual_seed(spec["seed"])
    c, n, size = spec["channels"], spec["batch"], spec["size"]
    layers: list[nn.Module] = []
    front = spec["front"]
    if front == "dense":
        # A first layer of its own: an in-place first layer would write into the caller's leaf,
        # which the plain model refuses as well.
        x, width = torch.randn(n, size), size
        layers.append(nn.Linear(size, size))
    elif front == "tokens":
        x = torch.randint(0, 7, (n, 3))
        layers += [nn.Embedding(7, size), nn.Flatten()]
        width = 3 * size
    else:
        conv2d = front == "conv2d"
        x = torch.randn(n, c, size, size) if conv2d else torch.randn(n, c, size)
        conv, norm = (nn.Conv2d, nn.BatchNorm2d) if conv2d else (nn.Conv1d, nn.BatchNorm1d)
        layers.append(conv(c, 2, 3, padding=1))
        if spec["front_bn"]:
            layers.append(norm(2))
        layers.append(nn.ReLU(inplace=True))
        if conv2d:
            layers.append(nn.Dropout2d(0.3))
        layers.append(nn.Flatten())
        width = 2 * size * (size if conv2d else 1)
    body: list[nn.Module] = []
    for kind in spec["body"]:
        if kind == "linear":
            body.append(nn.Linear(width, 3))
            width = 3
        else:
            body.append(_same_width(kind, width))
    if spec["tuple_span"] is not None:
        start, length = spec["tuple_span"]
        inner = [OnFirst(m) for m in body[start : start + length]]
        body = [*body[:start], Fork(), *inner, Merge(), *body[start + length :]]
    layers += [*body, nn.Linear(width, 2)]
    model = nn.Sequential(*layers).to(DTYPE)
    return model, x.to(DTYPE) if x.is_floating_point() else x


def plain_can_train(spec: dict[str, Any]) -> bool:
    """Whether the plain model trains on every micro-batch of this run.

    Some drawn models cannot: an in-place ReLU after a layer that saves its output (Tanh,
    another in-place ReLU), or BatchNorm1d on a micro-batch of one row.
    """
    model, x = build(spec)
    try:
        for mb in scatter(x, spec["chunks"]):
            mb = mb.clone().requires_grad_(mb.is_floating_point())
            model(mb).sum().backward()
    except (RuntimeError, ValueError):
        return False
    return True


def _same_width(kind: str, width: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(width)
    if kind == "batchnorm":
        return nn.BatchNorm1d(width)
    if kind == "dropout":
        return nn.Dropout(0.4)
    return nn.ReLU(inplace=True) if kind == "relu_" else nn.Tanh()


def writes_into_its_input(spec: dict[str, Any]) -> bool:
    """Whether a stage after the first writes in place into its input other than through its
    first layers (for those, fastpipe hands the stage a copy). fastpipe refuses such a stage
    with an error that says what to change, where the plain model has no stage boundary."""
    model, x = build(spec)
    bounds = list(itertools.accumulate(spec["balance"], initial=0))
    value: Any = scatter(x, spec["chunks"])[0]
    with torch.no_grad():
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            part = nn.Sequential(*list(model)[a:b])
            before = [t._version for t in tensors_of(value)]
            out = part(value)
            if s > 0 and not first_layer_in_place(part) and before != [t._version for t in tensors_of(value)]:
                return True
            value = out
    return False


def usable(spec: dict[str, Any], x: torch.Tensor) -> list[int]:
    """The micro-batch sizes; rejects runs that the plain model cannot do either."""
    assume(plain_can_train(spec))
    return [len(mb) for mb in scatter(x, spec["chunks"])]


def reference(
    spec: dict[str, Any], model: nn.Sequential, x: torch.Tensor, seed: int, per_output: Any = None
) -> tuple[nn.Sequential, list[Any]]:
    ref = copy.deepcopy(model)
    if spec["deferred"]:
        ref = DeferredBatchNorm.convert(ref)
    outs = seeded_forward(ref, spec["balance"], x, spec["chunks"], step_seed_after(seed), per_output)
    if spec["deferred"]:
        commit_deferred_batch_norm(ref)
    return ref, outs


def reference_step(
    spec: dict[str, Any], model: nn.Sequential, x: torch.Tensor, target: torch.Tensor, loss_fn: nn.Module
) -> tuple[nn.Sequential, torch.Tensor]:
    """What ``train_step`` must do: the mean loss over micro-batches weighted by their rows, its
    gradients accumulated into the reference model; returns (model, loss)."""
    targets = scatter(target, spec["chunks"])
    ref, losses = reference(spec, model, x, spec["seed"], lambda m, out: loss_fn(out, targets[m]))
    total = sum(len(t) / len(x) * mb_loss for t, mb_loss in zip(targets, losses))
    total.backward()
    return ref, total.detach()


def assert_same_state(pipe: nn.Module, ref: nn.Module, what: str) -> None:
    params, ref_params = dict(pipe.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: grad of {name}"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"{what}: grad of {name}")
    buffers, ref_buffers = dict(pipe.named_buffers()), dict(ref.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, b in buffers.items():
        torch.testing.assert_close(b, ref_buffers[name], **TOL, msg=f"{what}: buffer {name}")


def make_pipe(spec: dict[str, Any], model: nn.Sequential) -> Pipe:
    return Pipe(
        copy.deepcopy(model),
        balance=spec["balance"],
        chunks=spec["chunks"],
        checkpoint=spec["checkpoint"],
        deferred_batch_norm=spec["deferred"],
    )


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastpipe. a batch of")  # more chunks than rows
        yield


# -- Pipe.forward + backward --------------------------------------------------------------


@settings(max_examples=150, **PROFILE)
@given(spec=specs())
def test_forward_backward_equals_plain(spec):
    model, x = build(spec)
    usable(spec, x)
    pipe = make_pipe(spec, model)
    grads = x.is_floating_point()
    xp, xr = x.clone().requires_grad_(grads), x.clone().requires_grad_(grads)
    refused = writes_into_its_input(spec)  # (before seeding: it draws)
    torch.manual_seed(spec["seed"])
    if refused:
        with pytest.raises(RuntimeError, match="in place"):
            pipe(xp).sum().backward()
        return
    out = pipe(xp)
    ref, outs = reference(spec, model, xr, spec["seed"])
    expected = torch.cat(outs)
    torch.testing.assert_close(out, expected, **TOL)
    weight = torch.randn_like(expected)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    if grads:
        torch.testing.assert_close(xp.grad, xr.grad, **TOL)
    assert_same_state(pipe, ref, "forward")


# -- train_step, every schedule -------------------------------------------------------------


def stages_for(spec: dict[str, Any]) -> int:
    return 2 if spec["schedule"] in ("interleaved", *V_SCHEDULES) else 1


@settings(max_examples=120, **PROFILE)
@given(spec=specs())
def test_train_step_equals_plain(spec):
    model, x = build(spec)
    sizes = usable(spec, x)
    virtual = stages_for(spec)
    assume(len(spec["balance"]) % virtual == 0)
    workers = len(spec["balance"]) // virtual
    assume(spec["schedule"] != "interleaved" or len(sizes) % workers == 0)  # Megatron's constraint
    assume(spec["schedule"] != "dualpipev" or len(sizes) >= 2 * workers)  # DualPipeV's: M >= stages
    target = torch.randn(len(x), 2, dtype=DTYPE)
    loss_fn = nn.MSELoss()
    pipe = make_pipe(spec, model)
    refused = writes_into_its_input(spec)  # (before seeding: it draws)
    torch.manual_seed(spec["seed"])
    if refused:
        with pytest.raises(RuntimeError, match="in place"):
            pipe.train_step(x, target, loss_fn, schedule=spec["schedule"], virtual_stages=virtual)
        return
    loss = pipe.train_step(x, target, loss_fn, schedule=spec["schedule"], virtual_stages=virtual)
    ref, total = reference_step(spec, model, x, target, loss_fn)
    torch.testing.assert_close(loss, total, **TOL)
    assert_same_state(pipe, ref, f"train_step {spec['schedule']}")


# -- Pipe.fit(consistency="sync"), with and without virtual stages ---------------------------


@settings(max_examples=60, **PROFILE)
@given(spec=specs(), window=st.integers(1, 3), minibatches=st.integers(1, 4))
def test_fit_sync_equals_train_step_then_step(spec, window, minibatches):
    # fit's flushed stream sums each stage's micro-batches in 1F1B's order (interleaved's with
    # virtual stages), so it must equal train_step + optimizer.step() on those schedules bit for
    # bit: losses, parameters and buffers. Dropout masks come from one step seed per window
    # (per train_step in the reference), so dropout only with a window of one mini-batch.
    model, x = build(spec)
    sizes = usable(spec, x)
    virtual = stages_for(spec)
    assume(len(spec["balance"]) % virtual == 0)
    assume(len(sizes) % (len(spec["balance"]) // virtual) == 0)  # Megatron's constraint
    assume(not writes_into_its_input(spec))
    if window > 1:
        assume("dropout" not in spec["body"] and spec["front"] != "conv2d")
    schedule = "interleaved" if virtual > 1 else "1f1b"
    g = torch.Generator().manual_seed(spec["seed"])
    batches = [
        (x * (1 + 0.25 * j) if x.is_floating_point() else x, torch.randn(len(x), 2, dtype=DTYPE, generator=g))
        for j in range(minibatches)
    ]
    loss_fn = nn.MSELoss()

    def fresh() -> tuple[Pipe, torch.optim.Optimizer]:
        pipe = Pipe(
            copy.deepcopy(model),
            balance=spec["balance"],
            chunks=spec["chunks"],
            checkpoint=spec["checkpoint"],
            deferred_batch_norm=spec["deferred"],
            schedule=schedule,
            virtual_stages=virtual,
        )
        return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)

    ref, opt = fresh()
    torch.manual_seed(spec["seed"])
    expected = []
    for xb, yb in batches:
        opt.zero_grad(set_to_none=True)
        expected.append(ref.train_step(xb, yb, loss_fn))
        opt.step()
    pipe, opt2 = fresh()
    torch.manual_seed(spec["seed"])
    losses = list(pipe.fit(batches, loss_fn, opt2, consistency="sync", window=window))
    assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
    got, want = pipe.state_dict(), ref.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# -- DistributedPipe on 2 gloo ranks --------------------------------------------------------


def _distributed(rank: int, world: int, specs_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from fastpipe.distributed_pipe import DistributedPipe

    results = []
    for spec in specs_:
        model, x = build(spec)
        target = torch.randn(len(x), 2, dtype=DTYPE, generator=torch.Generator().manual_seed(spec["seed"]))
        pipe = DistributedPipe(
            copy.deepcopy(model),
            spec["balance"],
            chunks=spec["chunks"],
            checkpoint=spec["checkpoint"],
            deferred_batch_norm=spec["deferred"],
            schedule=spec["schedule"],
            timeout=60,
        )
        torch.manual_seed(spec["seed"])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="fastpipe. a batch of")
            loss = pipe.train_step(x if pipe.is_first else None, target if pipe.is_last else None, nn.MSELoss())
        results.append(
            {
                "loss": loss,
                "grads": {n: p.grad for n, p in pipe.named_parameters()},
                "buffers": dict(pipe.named_buffers()),
            }
        )
        pipe.close()
    return results


def dist_specs() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Runs for 2 ranks: 2 stages, or 4 interleaved or V-placed ones (2 per rank)."""

    def fits(spec: dict[str, Any]) -> bool:
        stages = len(spec["balance"])
        count = len(scatter(build(spec)[1], spec["chunks"]))
        if spec["schedule"] == "interleaved":
            # DistributedPipe builds the schedule for `chunks` up front; the step runs `count`.
            return stages == 4 and count % 2 == 0 and spec["chunks"] % 2 == 0
        if spec["schedule"] in V_SCHEDULES:  # 4 stages in a V; DualPipeV needs M >= 4 (chunks and count)
            return stages == 4 and (spec["schedule"] == "zb-v" or min(count, spec["chunks"]) >= 4)
        return stages == 2

    def works(spec: dict[str, Any]) -> bool:
        return plain_can_train(spec) and not writes_into_its_input(spec)  # the refusal is tested locally

    return st.lists(specs(max_stages=4).filter(fits).filter(works), min_size=3, max_size=3)


# Each example spawns the ranks once and runs 3 models there; no shrinking (each try spawns).
@settings(max_examples=2, phases=(Phase.explicit, Phase.generate), **PROFILE)
@given(runs=dist_specs())
def test_distributed_train_step_equals_plain(runs):
    outcomes = check_ok(run_ranks(_distributed, 2, runs, timeout=240))
    for i, spec in enumerate(runs):
        model, x = build(spec)
        target = torch.randn(len(x), 2, dtype=DTYPE, generator=torch.Generator().manual_seed(spec["seed"]))
        ref, total = reference_step(spec, model, x, target, nn.MSELoss())
        grads = {n: p.grad for n, p in ref.named_parameters()}
        buffers = dict(ref.named_buffers())
        what = f"run {i} ({spec['schedule']}, balance {spec['balance']})"
        for rank, result in enumerate(outcomes):
            torch.testing.assert_close(result[i]["loss"], total, **TOL, msg=f"{what}: loss on rank {rank}")
            for name, g in result[i]["grads"].items():
                assert (g is None) == (grads[name] is None), f"{what}: grad of {name}"
                if g is not None:
                    torch.testing.assert_close(g, grads[name], **TOL, msg=f"{what}: grad of {name}")
            for name, b in result[i]["buffers"].items():
                torch.testing.assert_close(b, buffers[name], **TOL, msg=f"{what}: buffer {name}")
        held = set(itertools.chain.from_iterable(r[i]["grads"] for r in outcomes))
        assert held == set(grads), f"{what}: the ranks hold {sorted(held)}"
