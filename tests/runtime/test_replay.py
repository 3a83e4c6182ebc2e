"""Recomputation replays exactly what the forward did: every random op, and no input write twice.

The property: a checkpointed run equals a non-checkpointed one bit for bit, and both equal
the plain model run micro-batch by micro-batch with each task's seed (tests/_seeded_reference).
"""

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from _seeded_reference import seeded_forward, step_seed_after
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe.runtime.step as step_core
from fastpipe import Pipe
from fastpipe.kernels import Dropout as FusedDropout
from fastpipe.rng import register_deterministic, register_random_op
from fastpipe.rng.streams import TaskRNG, may_draw, task_seed

DIM = 8


class SDPA(nn.Module):
    """Self-attention through F.scaled_dot_product_attention with dropout on the weights."""

    def __init__(self, p=0.5):
        super().__init__()
        self.qkv, self.p = nn.Linear(DIM, 3 * DIM), p

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        return y.transpose(1, 2).reshape(n, t, DIM)


class MHA(nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.attn, self.need_weights = nn.MultiheadAttention(DIM, 2, dropout=0.5, batch_first=True), need_weights

    def forward(self, x):
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


class FunctionalDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.3, self.training)


class LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(DIM, DIM, num_layers=2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


LAYERS = {
    "sdpa": lambda: SDPA(),
    "mha_weights": lambda: MHA(need_weights=True),
    "mha_sdpa": lambda: MHA(need_weights=False),
    "mha_layer": lambda: nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.5, batch_first=True),
    "f_dropout": lambda: FunctionalDropout(),
    "nn_dropout": lambda: nn.Dropout(0.4),
    "fused_dropout": lambda: FusedDropout(0.4),
    "lstm": lambda: LSTM(),
}


def model(kind):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(DIM, DIM), LAYERS[kind](), nn.Linear(DIM, DIM), LAYERS[kind](), nn.Tanh())


def run(net, checkpoint, seed=7, chunks=3, balance=(2, 3), x=None, devices=None):
    pipe = Pipe(net, balance=list(balance), chunks=chunks, checkpoint=checkpoint, devices=devices)
    x = torch.randn(6, 4, DIM) if x is None else x
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = pipe(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in pipe.parameters()]


def assert_equal_runs(a, b, what, exact=True):
    # ``exact=False``: the arithmetic differs between the runs (CPU RNNs take a oneDNN kernel
    # without grad, ATen's with), so float64 and a bound far below what a wrong mask moves.
    def same(x, y, msg):
        if exact:
            assert torch.equal(x, y), msg
        else:
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=msg)

    same(a[0], b[0], f"{what}: outputs differ")
    same(a[1], b[1], f"{what}: input gradients differ")
    for i, (p, q) in enumerate(zip(a[2], b[2])):
        same(p, q, f"{what}: gradient of parameter {i} differs")


@pytest.mark.parametrize("kind", list(LAYERS))
def test_checkpointed_equals_not_checkpointed_bit_for_bit(kind):
    exact = kind != "lstm"
    dtype = torch.float32 if exact else torch.float64
    x = torch.randn(6, 4, DIM, dtype=dtype)
    never = run(model(kind).to(dtype), "never", x=x)
    for mode in ("always", "except_last"):
        assert_equal_runs(never, run(model(kind).to(dtype), mode, x=x), f"{kind}, checkpoint={mode}", exact)
    # ...and the dropout really draws: another step seed gives other numbers.
    assert not torch.allclose(never[0], run(model(kind).to(dtype), "never", seed=8, x=x)[0])


@pytest.mark.parametrize("kind", ["sdpa", "mha_sdpa", "mha_layer", "nn_dropout", "fused_dropout"])
def test_pipe_equals_plain_model_with_task_seeds(kind):
    net, x = model(kind), torch.randn(7, 4, DIM)
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[2, 3], chunks=3, checkpoint="except_last")
    torch.manual_seed(11)
    out = pipe(x)
    expected = torch.cat(seeded_forward(ref, [2, 3], x, 3, step_seed_after(11)))
    assert torch.equal(out, expected)


def test_default_generators_are_left_alone():
    # The caller's generator moves by one draw per step (the step seed), nothing more.
    pipe = Pipe(model("sdpa"), balance=[2, 3], chunks=3)
    torch.manual_seed(5)
    pipe(torch.randn(6, 4, DIM)).sum().backward()
    after = torch.rand(4)
    torch.manual_seed(5)
    torch.randn(6, 4, DIM)
    torch.empty((), dtype=torch.int64).random_(0, 1 << 62)
    assert torch.equal(after, torch.rand(4))


def test_concurrent_cpu_stages_draw_from_their_own_streams():
    # Two CPU workers draw from torch's one CPU generator at the same time; each task must
    # still see only its own stream, whatever the interleaving. Many draws per task make
    # interleavings likely; every run must equal the first.
    class Noisy(nn.Module):
        def forward(self, x):
            for _ in range(20):
                x = F.scaled_dot_product_attention(x, x, x, dropout_p=0.2) + torch.rand_like(x)
            return x

    def once():
        torch.manual_seed(3)
        pipe = Pipe(nn.Sequential(Noisy(), Noisy()), balance=[1, 1], chunks=6, checkpoint="except_last")
        x = torch.randn(12, 2, 4, 4, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        return out.detach(), x.grad

    first = once()
    for _ in range(4):
        again = once()
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_random_ops_replay_under_task_rng_across_threads():
    # The same task seed replays SDPA's dropout in other threads while another task draws
    # from the same default generator all along. (A thread drawing outside any task is not
    # covered: it races with the tasks, as with any other thread; see fastpipe.rng.streams.)
    x = torch.randn(2, 2, 8, 4)
    results = {}
    stop = threading.Event()

    def disturb():
        with TaskRNG(5):
            while not stop.is_set():
                torch.rand(64)

    def task(name):
        with TaskRNG(task_seed(1, 2, 3)):
            results[name] = F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)

    noise = threading.Thread(target=disturb)
    noise.start()
    try:
        threads = [threading.Thread(target=task, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        noise.join()
    assert all(torch.equal(results[0], results[i]) for i in range(1, 4))


def test_stage_without_random_layers_runs_without_the_mode(monkeypatch):
    made = []

    class Counting(TaskRNG):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(step_core, "TaskRNG", Counting)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.LayerNorm(4))
    Pipe(plain, balance=[2, 2], chunks=2)(torch.randn(4, 4)).sum().backward()
    assert not made
    Pipe(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), balance=[1, 1], chunks=2)(torch.randn(4, 4))
    assert len(made) == 2  # only the dropout stage's two tasks


def test_may_draw():
    assert not may_draw(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Conv1d(2, 2, 1), nn.Embedding(3, 2)))
    assert may_draw(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    assert not may_draw(nn.Sequential(nn.Linear(2, 2), nn.Dropout()).eval())
    assert may_draw(nn.FractionalMaxPool2d(2, output_size=1).eval())
    assert may_draw(FunctionalDropout())  # custom forward: cannot see through it
    assert may_draw(nn.Linear(2, 2), lambda out, t: out.sum())
    assert not may_draw(nn.Linear(2, 2), F.mse_loss)
    assert not may_draw(nn.Linear(2, 2), nn.MSELoss())
    hooked = nn.Linear(2, 2)
    handle = hooked.register_forward_hook(lambda *a: None)
    assert may_draw(hooked)
    handle.remove()
    assert not may_draw(hooked)

    class Quiet(nn.Module):
        def forward(self, x):
            return x * 2

    assert may_draw(Quiet())
    register_deterministic(Quiet)
    assert not may_draw(Quiet())


def test_unrouted_draw_warns_and_registering_routes_it():
    op = torch.ops.aten.bernoulli.p  # an op the task RNG does not know, drawing from the default generator

    class Raw(nn.Module):
        def forward(self, x):
            return x * op(torch.full_like(x, 0.5), 0.5)

    def once(checkpoint):
        torch.manual_seed(2)
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Raw()), balance=[1, 1], chunks=2, checkpoint=checkpoint)
        x = torch.randn(4, 4)
        out = pipe(x)
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in pipe.parameters()]

    with pytest.warns(RuntimeWarning, match="register_random_op"):
        once("always")
    register_random_op(op)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            never = once("never")
            always = once("always")
        assert torch.equal(never[0], always[0])
        for a, b in zip(never[1], always[1]):
            assert torch.equal(a, b)
    finally:
        from fastpipe.rng.streams import RANDOM_OPS

        RANDOM_OPS.discard(op)


# -- in-place writes to a stage input that needs no gradient ----------------------------


class WritesIntoInput(nn.Module):
    def forward(self, inp):
        foo, bar = inp
        bar.add_(1)
        return foo * bar


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_inplace_write_to_input_under_checkpoint_is_refused(checkpoint):
    pipe = Pipe(nn.Sequential(nn.Identity(), WritesIntoInput()), balance=[1, 1], chunks=2, checkpoint=checkpoint)
    foo, bar = torch.ones(2, 2, requires_grad=True), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=r"tensor 1 of the input tuple of stage 1 .* written in place.*clone"):
        pipe((foo, bar))


def test_inplace_write_to_input_without_checkpoint_equals_plain():
    # One micro-batch: with several, they are views of the caller's tensor sharing its version
    # counter, and autograd itself refuses the second write (as it would for the plain model
    # fed the same views).
    net = nn.Sequential(nn.Identity(), WritesIntoInput())
    pipe = Pipe(copy.deepcopy(net), balance=[1, 1], chunks=1, checkpoint="never")
    foo, bar = torch.ones(2, 2, requires_grad=True), torch.ones(2, 2)
    pipe((foo, bar)).sum().backward()
    assert torch.equal(bar, torch.full((2, 2), 2.0))  # written once, as by the plain model
    assert torch.equal(foo.grad, torch.full((2, 2), 2.0))


def test_input_changed_between_forward_and_recompute_is_refused():
    # The caller writes into its input after the forward: the recompute would see other values.
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), balance=[1, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    out = pipe(x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="between its checkpointed forward and the recompute"):
        out.sum().backward()


def test_inplace_first_layer_still_works_under_checkpoint():
    # A first layer working in place gets a copy (clone_input): nothing to refuse there.
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[1, 2], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    out = pipe(x)
    # Micro-batches of 2 rows against the full batch of 4 run other GEMM shapes: equal up to
    # rounding, over two Linears of 4 inputs each.
    assert_close_reordered(out, ref(x), k=4 + 4)
    out.sum().backward()


# -- side effects of a replayed forward ------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_batchnorm_running_statistics_are_updated_once(checkpoint):
    # The recompute must not update BatchNorm's running statistics a second time.
    def buffers(mode):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
        pipe = Pipe(net, balance=[2, 2], chunks=3, checkpoint=mode)
        pipe(torch.randn(9, 4)).sum().backward()
        return {n: b.clone() for n, b in pipe.named_buffers()}

    never, other = buffers("never"), buffers(checkpoint)
    for name, b in never.items():
        assert torch.equal(b, other[name]), name


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inplace_layer_behind_a_view_at_a_stage_start(checkpoint):
    # Flatten returns a view of the stage input; the in-place ReLU after it writes into the
    # input, so the stage must get a copy, as when the in-place layer comes first.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Flatten(), nn.ReLU(inplace=True), nn.Linear(4, 2))
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[1, 3], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    out = pipe(x)
    expected = torch.cat([ref(mb) for mb in x.chunk(2)])
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


# -- CUDA: the generator is per device; stages sharing a GPU draw at the same time -------------
# CUDA attention kernels may accumulate gradients in a nondeterministic order (atomics), so
# gradients are compared within float32 tolerance; a wrong mask moves them by orders more.

GPU_PLACEMENTS = [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]]


def gpu_train(kind, devices, checkpoint, schedule="1f1b", seed=7):
    pipe = Pipe(model(kind), balance=[2, 3], devices=devices, chunks=3, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, DIM, generator=g), torch.randn(6, 4, DIM, generator=g)
    torch.manual_seed(seed)
    loss = pipe.train_step(x.to(devices[0]), y.to(devices[-1]), nn.MSELoss(), schedule=schedule)
    return loss.cpu(), [p.grad.cpu() for p in pipe.parameters()]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices", GPU_PLACEMENTS)
@pytest.mark.parametrize("kind", ["sdpa", "mha_sdpa", "mha_layer", "nn_dropout", "fused_dropout"])
def test_gpu_checkpoint_modes_replay_the_same_masks(kind, devices):
    never = gpu_train(kind, devices, "never")
    for mode in ("always", "except_last"):
        other = gpu_train(kind, devices, mode)
        torch.testing.assert_close(other[0], never[0], rtol=1e-6, atol=1e-7, msg=f"{kind} {mode}: loss")
        for i, (a, b) in enumerate(zip(other[1], never[1])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{kind} {mode}: grad {i}")
    assert not torch.allclose(never[0], gpu_train(kind, devices, "never", seed=8)[0])  # dropout draws


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sdpa", "mha_layer", "nn_dropout"])
def test_gpu_stages_sharing_a_device_are_reproducible(kind):
    # Two workers launch random kernels on cuda:0 at the same time; each must draw its own stream.
    first = gpu_train(kind, ["cuda:0", "cuda:0"], "except_last", schedule="gpipe")
    for _ in range(3):
        again = gpu_train(kind, ["cuda:0", "cuda:0"], "except_last", schedule="gpipe")
        torch.testing.assert_close(again[0], first[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sdpa", "mha_sdpa", "nn_dropout"])
def test_gpu_pipe_equals_plain_model_with_task_seeds(kind):
    net = model(kind)
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[2, 3], devices=["cuda:0", "cuda:0"], chunks=3)
    x = torch.randn(6, 4, DIM, device="cuda")
    torch.manual_seed(11)
    with torch.no_grad():
        out = pipe(x)
        expected = torch.cat(seeded_forward(ref, [2, 3], x, 3, step_seed_after(11)))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_pipe_forward_backward_replays_attention_dropout():
    # Pipe.forward + loss.backward() with CUDA stages: the backward runs on autograd's device thread.
    x = torch.randn(6, 4, DIM, device="cuda")

    def once(checkpoint):
        return run(model("sdpa"), checkpoint, x=x, devices=["cuda:0", "cuda:0"])

    never = once("never")
    for mode in ("always", "except_last"):
        other = once(mode)
        torch.testing.assert_close(other[0], never[0], rtol=1e-6, atol=1e-7)
        for a, b in zip(other[2], never[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_inplace_write_into_a_received_activation_says_what_to_change():
    # Without checkpointing too: stage 1 gets its input as an autograd leaf.
    class AddsOne(nn.Module):
        def forward(self, x):
            return x.add_(1)

    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), AddsOne()), balance=[2, 1], chunks=2, checkpoint="never")
    with pytest.raises(RuntimeError, match=r"stage 1 writes in place into its input.*clone"):
        pipe(torch.randn(4, 4))


def test_current_generator_follows_the_task_stream():
    from fastpipe.rng import current_generator

    def draw(seed):
        with TaskRNG(seed):
            return torch.randn(3, generator=current_generator()), torch.randn(3, generator=current_generator())

    a, b = draw(4), draw(4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1])  # each call moves the stream on
    assert not torch.equal(a[0], draw(5)[0])
    assert current_generator() is torch.default_generator  # outside a task


def test_torch_utils_checkpoint_inside_a_stage_replays_dropout():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, inner_checkpoint):
            super().__init__()
            self.f, self.inner_checkpoint = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), inner_checkpoint

        def forward(self, x):
            return checkpoint(self.f, x, use_reentrant=False) if self.inner_checkpoint else self.f(x)

    def once(inner_checkpoint):
        torch.manual_seed(0)
        pipe = Pipe(
            nn.Sequential(nn.Linear(8, 8), Block(inner_checkpoint), nn.Linear(8, 8)),
            balance=[1, 2],
            chunks=2,
            checkpoint="never",
        )
        torch.manual_seed(1)
        pipe(torch.randn(4, 8)).sum().backward()
        return pipe[0].weight.grad

    assert torch.equal(once(False), once(True))
