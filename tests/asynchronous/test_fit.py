"""Pipe.fit: sync equals train_step + optimizer.step(); stash and predict keep forward and backward on
one version; weight prediction follows the optimizer; a run resumed from a mid-stream save is the same run."""

from __future__ import annotations

import os

import pytest
import torch
from _fit_resume import whole_and_resumed
from torch import Tensor, nn

from fastpipe import Pipe
from fastpipe.asynchronous import predict_weights, update_direction, weight_copy_bytes
from fastpipe.asynchronous.weights import StageWeights
from fastpipe.schedule import ScheduleError
from fastpipe.step import microbatch


def model(seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def data(n: int, batch: int = 12) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunks", [1, 4])
def test_sync_equals_train_step_then_step(name: str, chunks: int) -> None:
    batches = data(5, batch=13)  # 13 in 4 chunks: uneven micro-batches
    ref = Pipe(model(), balance=[3, 2, 2], chunks=chunks)
    opt = OPTIMIZERS[name](ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    expected = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        expected.append(ref.train_step(x, y, nn.MSELoss()))
        opt.step()
        sched.step()
    pipe = Pipe(model(), balance=[3, 2, 2], chunks=chunks)
    opt2 = OPTIMIZERS[name](pipe.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    run = pipe.fit(batches, nn.MSELoss(), opt2, consistency="sync", scheduler=sched2, window=2)
    assert len(run) == len(batches)
    losses = list(run)
    assert run.steps == len(batches) and list(run.weight_copy_bytes.values()) == [0, 0, 0]
    for got, want in zip(losses, expected):
        assert torch.equal(got, want)
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


class _Projection(nn.Module):
    """Identity in forward; owns the weight that the loss applies (like fastpipe train's LMHead)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16) / 4)

    def forward(self, h: Tensor) -> Tensor:
        return h


class _ProjectedMSE:
    reduction = "mean"

    def __init__(self, head: _Projection) -> None:
        self.head = head

    def __call__(self, h: Tensor, y: Tensor) -> Tensor:
        return nn.functional.mse_loss(h @ self.head.weight.t(), y)


@pytest.mark.parametrize("consistency", ["sync", "predict"])
def test_a_loss_that_reads_last_stage_weights_trains_them(consistency: str) -> None:
    def build() -> tuple[Pipe, torch.optim.Optimizer]:
        torch.manual_seed(5)
        pipe = Pipe(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), _Projection()), balance=[2, 2], chunks=2
        )
        return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-2)

    batches = data(3)
    ref, opt = build()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        ref.train_step(x, y, _ProjectedMSE(ref[3]))
        opt.step()
    pipe, opt2 = build()
    before = pipe[3].weight.detach().clone()
    list(pipe.fit(batches, _ProjectedMSE(pipe[3]), opt2, consistency=consistency, window=3))
    # Adam moves a weight with a gradient by about lr per update (3 here); without one it stays.
    assert (pipe[3].weight - before).abs().mean() > 1e-2
    if consistency == "sync":
        for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), n


def test_sync_clips_each_stage() -> None:
    batches = data(3)
    ref = Pipe(model(), balance=[3, 4], chunks=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        ref.train_step(x, y, nn.MSELoss())
        for part in ref.partitions:
            torch.nn.utils.clip_grad_norm_(part.parameters(), 0.05)
        opt.step()
    pipe = Pipe(model(), balance=[3, 4], chunks=2)
    list(
        pipe.fit(
            batches, nn.MSELoss(), torch.optim.SGD(pipe.parameters(), lr=0.5), consistency="sync", max_grad_norm=0.05
        )
    )
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert torch.equal(p, q)


class Probe(nn.Module):
    """x * w, recording the w its forward and its backward computed with (per call, in order)."""

    def __init__(self, log: dict[str, list[Tensor]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.log = log

    def forward(self, x: Tensor) -> Tensor:
        return _Probe.apply(x, self.weight, self.log)


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, log):  # type: ignore[override]
        log["forward"].append(w.detach().clone())
        ctx.save_for_backward(x, w)
        ctx.log = log
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log["backward"].append(w.detach().clone())
        return grad * w, (grad * x).sum(0), None


def probe_run(consistency: str, steps: int = 6) -> tuple[dict[str, list[Tensor]], list[tuple[Tensor, Tensor]]]:
    """K=3 stages, M=1; returns the probe's log and, per update of stage 0, (weights before it, its gradient)."""
    log: dict[str, list[Tensor]] = {"forward": [], "backward": []}
    torch.manual_seed(0)
    seq = nn.Sequential(Probe(log), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    pipe = Pipe(seq, balance=[1, 1, 2], chunks=1, checkpoint="never")
    live: list[tuple[Tensor, Tensor]] = []
    seq[0].weight.register_post_accumulate_grad_hook(
        lambda p: live.append((p.detach().clone(), p.grad.detach().clone()))
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    list(pipe.fit(data(steps), nn.MSELoss(), opt, consistency=consistency, window=steps))
    return log, live


@pytest.mark.parametrize("consistency", ["stash", "predict"])
def test_backward_sees_the_forward_weights(consistency: str) -> None:
    log, _ = probe_run(consistency)
    assert len(log["forward"]) == len(log["backward"]) == 6  # one stage, M=1: backwards in forward order
    for f, b in zip(log["forward"], log["backward"]):
        assert torch.equal(f, b)


def test_stale_backward_sees_newer_weights() -> None:
    # The naive baseline: stage 0 of 3 has two updates in flight, so its backwards read moved weights.
    log, _ = probe_run("stale")
    assert any(not torch.equal(f, b) for f, b in zip(log["forward"], log["backward"]))


def test_stash_keeps_the_version_it_ran_on() -> None:
    # Stage 0 of K=3 at M=1: micro-batch m's forward runs on the weights after m-2 updates (0 for m < 2).
    log, grads_seen = probe_run("stash")
    torch.manual_seed(0)
    w0 = torch.ones(8)
    assert torch.equal(log["forward"][0], w0) and torch.equal(log["forward"][1], w0)
    assert torch.equal(log["forward"][2], w0)  # U0 lands after F2 on stage 0 (2 warm-up forwards)
    assert not torch.equal(log["forward"][3], w0)


def test_predict_forward_weights_by_hand() -> None:
    # Stage 0 of K=3 at M=1 runs F0 F1 F2 BW0 U0 F3 BW1 U1 F4 ...: micro-batch m's forward sees
    # t = max(m - 2, 0) updates, and its gradient is applied by the (m+1)-th: lag min(m, 2).
    # Predicted: W_t - lr * lag * v_t, with v_t SGD's momentum buffer after t updates (none at t = 0).
    log, live = probe_run("predict")
    lr, mu = 0.5, 0.9
    buffers: list[Tensor] = []
    for _, g in live:
        buffers.append(g.clone() if not buffers else buffers[-1] * mu + g)
    for m, seen in enumerate(log["forward"]):
        t, lag = max(m - 2, 0), min(m, 2)
        expected = live[t][0] if t == 0 else live[t][0] - (lr * lag) * buffers[t - 1]
        torch.testing.assert_close(seen, expected, rtol=1e-6, atol=1e-7, msg=f"micro-batch {m}")


def test_predict_runs_ahead_of_the_live_weights() -> None:
    stale, _ = probe_run("stale")
    pred, _ = probe_run("predict")
    # Micro-batch 0 and those before any optimizer state run on the live weights; later ones on a prediction.
    assert torch.equal(stale["forward"][0], pred["forward"][0])
    assert not torch.equal(stale["forward"][4], pred["forward"][4])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_update_direction_is_the_step_just_taken(kind: str) -> None:
    p = nn.Parameter(torch.randn(5))
    opt = (
        torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
        if kind == "sgd"
        else torch.optim.Adam([p], lr=0.1, weight_decay=0.01, amsgrad=True)
    )
    assert update_direction(opt, [p]) == [None]
    for i in range(3):
        before = p.detach().clone()
        p.grad = torch.randn(5) * (i + 1)
        opt.step()
        (delta,) = update_direction(opt, [p])
        assert delta is not None
        torch.testing.assert_close((before - p.detach()) / 0.1, delta)


def test_adamw_direction_adds_decoupled_decay() -> None:
    p = nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5)
    for _ in range(2):
        before = p.detach().clone()
        p.grad = torch.randn(5)
        opt.step()
        (delta,) = update_direction(opt, [p])
        assert delta is not None
        # AdamW: p <- p(1 - lr·λ) - lr·m̂/(√v̂+ε); Δ uses the current p for the decay term.
        adam_part = (before * (1 - 0.1 * 0.5) - p.detach()) / 0.1
        torch.testing.assert_close(delta - 0.5 * p.detach(), adam_part)


PREDICTABLE = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, eps=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
}


LAYOUTS = {  # contiguous fp32 takes fastpipe._C's one pass; the others torch's three
    "fp32": lambda: torch.randn(64, 3),
    "transposed": lambda: torch.randn(3, 64).t(),
    "fp64": lambda: torch.randn(64, 3, dtype=torch.float64),
    "cuda": lambda: torch.randn(64, 3, device="cuda"),  # torch's passes on the device
}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.gpu) if k == "cuda" else k for k in sorted(LAYOUTS)]
)
@pytest.mark.parametrize("kind", sorted(PREDICTABLE))
def test_predict_weights_is_w_minus_total_times_direction(kind: str, layout: str) -> None:
    # The fused arithmetic against the direction it rearranges.
    p, q = nn.Parameter(LAYOUTS[layout]()), nn.Parameter(torch.randn(7))
    opt = PREDICTABLE[kind]([p, q])
    (fresh_p, fresh_q) = predict_weights(opt, [p, q], [0.3, 0.3])
    assert torch.equal(fresh_p, p) and torch.equal(fresh_q, q)  # no state yet: the weights themselves
    for i in range(3):
        p.grad, q.grad = torch.randn_like(p) * (i + 1), torch.randn(7)
        opt.step()
        out = [torch.full_like(p, float("nan")), torch.full_like(q, float("nan"))]
        got = predict_weights(opt, [p, q], [0.3, 0.7], out)
        assert got[0] is out[0] and got[1] is out[1]  # written into the buffers given
        for w, total, delta, pred in zip((p, q), (0.3, 0.7), update_direction(opt, [p, q]), got):
            assert delta is not None
            torch.testing.assert_close(pred, w.detach() - total * delta, rtol=1e-6, atol=1e-6)


def _counting_predictor(calls: list[object]):  # type: ignore[no-untyped-def]
    def predict(version: int, lag: int, out):  # type: ignore[no-untyped-def]
        calls.append(out)
        return [torch.zeros(4)] if out is None else out

    return predict


def test_a_released_prediction_is_the_buffer_of_the_next() -> None:
    # One prediction per mini-batch (M=2): the second mini-batch's is written into the first's buffers.
    calls: list[object] = []
    w = StageWeights([nn.Parameter(torch.ones(4))], "predict", {m: 1 for m in range(6)}, 2, _counting_predictor(calls))
    first = w.acquire(0)
    assert w.acquire(1) is first
    w.release(0), w.release(1)
    w.version += 1
    second = w.acquire(2)
    assert calls[0] is None and calls[1] is first and second[0] is first[0]
    w.release(2)
    assert len(w.pool) == 1 and w.pool[0][0] is first[0]
    assert w.copy_bytes == 0 and w.peak_copy_bytes == 16


def test_stash_copies_on_write_into_a_released_stash() -> None:
    p = nn.Parameter(torch.ones(4))
    w = StageWeights([p], "stash", {m: 1 for m in range(4)}, 1)
    v0 = w.acquire(0)
    w.before_update()  # micro-batch 0 still holds version 0: p moves to new storage
    p.data.add_(1)
    w.version += 1
    assert v0[0].data_ptr() != p.data_ptr() and torch.equal(v0[0], torch.ones(4))
    v1 = w.acquire(1)
    w.release(0)
    assert len(w.pool) == 1 and w.pool[0] is v0
    w.before_update()  # version 1 is in use again: the parameter moves into version 0's old buffer
    assert p.data_ptr() == v0[0].data_ptr() and w.pool == []
    assert v1[0].data_ptr() != p.data_ptr() and torch.equal(p, v1[0])


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (lambda ps: torch.optim.RMSprop(ps), "SGD .*Adam.*AdamW"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "momentum > 0"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
    ],
)
def test_predict_refuses_unknown_directions(optimizer, match: str) -> None:
    pipe = Pipe(model(), balance=[3, 4])
    with pytest.raises(ValueError, match=match):
        pipe.fit(data(1), nn.MSELoss(), optimizer(pipe.parameters()), consistency="predict")
    # the other policies take any optimizer
    assert len(list(pipe.fit(data(1), nn.MSELoss(), optimizer(pipe.parameters()), consistency="stash"))) == 1


def test_bad_arguments_are_refused() -> None:
    pipe = Pipe(model(), balance=[3, 4])
    opt = torch.optim.Adam(pipe.parameters())
    with pytest.raises(ValueError, match="consistency must be one of"):
        pipe.fit(data(1), nn.MSELoss(), opt, consistency="async")
    with pytest.raises(ValueError, match="window"):
        pipe.fit(data(1), nn.MSELoss(), opt, window=0)
    with pytest.raises(ValueError, match="not trainable parameters of this pipe"):
        pipe.fit(data(1), nn.MSELoss(), torch.optim.Adam([nn.Parameter(torch.ones(1))]))
    with pytest.raises(TypeError, match="batches of \\(input, target\\)"):
        next(pipe.fit([torch.ones(2, 8)], nn.MSELoss(), opt))


@pytest.mark.parametrize("consistency", ["predict", "stash"])
def test_mid_stream_save_and_resume(consistency: str, tmp_path: os.PathLike) -> None:
    def fresh() -> tuple[Pipe, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        pipe = Pipe(model(), balance=[2, 2, 3], chunks=2)
        opt = torch.optim.Adam(pipe.parameters(), lr=2e-2)
        return pipe, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    whole, _, resumed, _ = whole_and_resumed(fresh, data(8), consistency, tmp_path)
    assert resumed == whole


def test_weight_copy_bytes_match_the_schedule() -> None:
    pipe = Pipe(model(), balance=[2, 2, 3], chunks=1)
    sizes = [sum(p.numel() * p.element_size() for p in part.parameters()) for part in pipe.partitions]
    for consistency, copies in (("stash", [2, 1, 0]), ("predict", [3, 2, 0]), ("stale", [0, 0, 0])):
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        run = pipe.fit(data(6), nn.MSELoss(), opt, consistency=consistency, window=6)
        list(run)
        assert list(run.weight_copy_bound.values()) == [c * n for c, n in zip(copies, sizes)]
        assert run.weight_copy_bytes == run.weight_copy_bound
        assert weight_copy_bytes(pipe)[consistency] == run.weight_copy_bound  # without running


def test_an_error_in_a_window_propagates_and_the_pipe_stays_usable() -> None:
    pipe = Pipe(model(), balance=[2, 2, 3], chunks=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    calls = []

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("bad loss")
        return nn.functional.mse_loss(out, y)

    with pytest.raises(RuntimeError, match="bad loss"):
        list(pipe.fit(data(4), loss_fn, opt, consistency="stash", window=4))
    assert all(p.grad is None for p in pipe.parameters())  # no half-applied gradient left behind
    x, y = data(1)[0]
    assert torch.isfinite(pipe.train_step(x, y, nn.MSELoss()))


@pytest.mark.gpu
@pytest.mark.parametrize("consistency", ["sync", "predict"])
def test_fit_on_cuda_stages(consistency: str) -> None:
    # Two stages on one GPU, each in its own worker thread: updates run on the stage's device.
    batches = [(x.cuda(), y.cuda()) for x, y in data(4)]
    ref = Pipe(model(), balance=[3, 4], devices=["cuda:0", "cuda:0"], chunks=2)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expected = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        expected.append(ref.train_step(x, y, nn.MSELoss()).item())
        opt.step()
    pipe = Pipe(model(), balance=[3, 4], devices=["cuda:0", "cuda:0"], chunks=2)
    opt2 = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = [loss.item() for loss in pipe.fit(batches, nn.MSELoss(), opt2, consistency=consistency, window=2)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.device.type == "cuda" for p in pipe.parameters())
    if consistency == "sync":
        # Same kernels, same order: equal up to the GEMM's possible run-to-run reordering on the device.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:fastpipe. a batch of 2 samples")
def test_a_short_mini_batch_runs_in_its_own_window() -> None:
    # 12 rows make 4 micro-batches, 2 rows only 2: the stream's M changes, so the short one gets a window.
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for n in (12, 12, 2, 12)]
    ref = Pipe(model(), balance=[3, 4], chunks=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        expected.append(ref.train_step(x, y, nn.MSELoss()))
        opt.step()
    pipe = Pipe(model(), balance=[3, 4], chunks=4)
    opt2 = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = list(pipe.fit(batches, nn.MSELoss(), opt2, consistency="sync", window=8))
    assert len(losses) == 4 and all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert list(pipe.fit([], nn.MSELoss(), opt2)) == []


@pytest.mark.parametrize("consistency", ["sync", "predict"])
def test_local_virtual_stages(consistency: str) -> None:
    # 4 stages on 2 workers (interleaved): sync sums each stage's micro-batches in the same order as
    # one worker per stage does, so it is bit-equal; predict follows the interleaved stream's own lags.
    batches = data(6)
    flat = Pipe(model(), balance=[2, 2, 2, 1], chunks=2)
    virtual = Pipe(model(), balance=[2, 2, 2, 1], chunks=2, schedule="interleaved", virtual_stages=2)
    runs = []
    for pipe in (flat, virtual):
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        run = pipe.fit(batches, nn.MSELoss(), opt, consistency=consistency, window=6)  # 6: steady state
        runs.append((run, [loss.item() for loss in run]))
    (flat_run, flat_losses), (virtual_run, virtual_losses) = runs
    if consistency == "sync":
        assert virtual_losses == flat_losses
        assert all(torch.equal(p, q) for p, q in zip(flat.parameters(), virtual.parameters()))
    else:
        assert virtual_losses != flat_losses  # other lags: stage 2 shares worker 0 with stage 0
        assert virtual_run.weight_copy_bytes == virtual_run.weight_copy_bound
        assert weight_copy_bytes(virtual)["predict"] == virtual_run.weight_copy_bound
        assert virtual_run.weight_copy_bound != flat_run.weight_copy_bound


def test_virtual_stages_refuse_a_short_last_mini_batch_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The warning comes once per (batch, chunks) in a process: forget any earlier test's.
    monkeypatch.setattr(microbatch, "_warned", set())
    pipe = Pipe(model(), balance=[2, 2, 2, 1], chunks=2, schedule="interleaved", virtual_stages=2)
    before = [p.detach().clone() for p in pipe.parameters()]
    batches = data(2) + [(torch.randn(1, 8), torch.randn(1, 4))]  # 1 row: one micro-batch, not a multiple of 2
    run = pipe.fit(batches, nn.MSELoss(), torch.optim.SGD(pipe.parameters(), lr=0.1), consistency="stale", window=4)
    with pytest.warns(UserWarning, match="splits into 1 micro-batches"):  # read with the first window
        assert len([next(run), next(run)]) == 2
    after = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(ScheduleError, match="multiple of 2 micro-batches.*drop_last=True"):
        next(run)
    assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), after))  # the failed window applied nothing
    assert not all(torch.equal(p, q) for p, q in zip(after, before))


def test_targets_go_to_the_last_stage_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU DataLoader's targets meet the loss on the last stage's device (a GPU there), as in
    # train_step; on this CPU host the move is watched through the function that makes it.
    import fastpipe.asynchronous.fit_run as fit_module

    moves: list[tuple[tuple[int, ...], torch.device]] = []
    real = fit_module.to_device

    def spy(value: object, device: torch.device) -> object:
        moves.append((tuple(value.shape), device))  # type: ignore[attr-defined]
        return real(value, device)

    monkeypatch.setattr(fit_module, "to_device", spy)
    pipe = Pipe(model(), balance=[4, 3], chunks=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = list(pipe.fit(data(2), nn.MSELoss(), opt, consistency="stale", window=2))
    assert len(losses) == 2
    assert moves == [((4, 4), pipe.devices[-1])] * 6  # 2 mini-batches x 3 micro-batches
