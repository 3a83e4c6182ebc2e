"""torch.utils.checkpoint inside a stage replays its dropout (fastpipe.rng.state)."""

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastpipe.rng.state as rng_state
from fastpipe import Pipe
from fastpipe.rng import register_deterministic
from fastpipe.rng.streams import TaskRNG, current_task


class Block(nn.Module):
    def __init__(self, inner: bool, reentrant: bool) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3))
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint(self.f, x, use_reentrant=self.reentrant) if self.inner else self.f(x)


def _grads(inner: bool, mode: str, reentrant: bool):
    torch.manual_seed(0)
    model = nn.Sequential(Block(inner, reentrant), Block(inner, reentrant), Block(inner, reentrant))
    pipe = Pipe(model, balance=[2, 1], chunks=4, checkpoint=mode)  # 2 CPU stages, concurrent workers
    torch.manual_seed(1)
    x = torch.randn(8, 8, requires_grad=True)
    out = pipe(x)
    out.square().sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in pipe.parameters())]


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_inner_checkpoint_equals_the_model_without_it(mode):
    # use_reentrant=False, preserve_rng_state=True (torch's default). The reentrant variant
    # refuses backward(inputs=...), which every stage's backward passes.
    want, got = _grads(False, mode, False), _grads(True, mode, False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert (want[0] == 0).any()  # dropout did drop


def test_outside_a_task_they_are_torchs_own():
    rng_state.install()  # idempotent
    funcs = (torch.get_rng_state, torch.set_rng_state, torch.random.fork_rng)
    rng_state.install()
    assert funcs == (torch.get_rng_state, torch.set_rng_state, torch.random.fork_rng)
    assert current_task() is None
    torch.manual_seed(3)
    assert torch.equal(torch.get_rng_state(), torch.default_generator.get_state())
    saved = torch.get_rng_state()
    a = torch.rand(4)
    torch.set_rng_state(saved)
    assert torch.equal(torch.default_generator.get_state(), saved)
    assert torch.equal(torch.rand(4), a)
    with torch.random.fork_rng(devices=[]):
        torch.rand(4)
    assert torch.equal(torch.rand(4), torch.manual_seed(3) and torch.rand(8)[4:])


def test_inside_a_task_they_address_its_stream_per_thread():
    torch.manual_seed(5)
    parked = torch.default_generator.get_state()
    seen = {}

    def run(seed):
        with TaskRNG(seed):
            state = torch.get_rng_state()
            first = torch.rand(3)
            torch.set_rng_state(state)
            seen[seed] = (state, first, torch.rand(3))

    threads = [threading.Thread(target=run, args=(s,)) for s in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, (state, first, again) in seen.items():
        assert torch.equal(state, torch.Generator().manual_seed(seed).get_state())
        assert torch.equal(first, again)
    assert torch.equal(torch.default_generator.get_state(), parked)  # untouched by the tasks


def test_a_stage_without_a_stream_sees_the_default_generator():
    @register_deterministic
    class Probe(nn.Module):
        def forward(self, x):
            seen.append((current_task(), torch.equal(torch.get_rng_state(), torch.default_generator.get_state())))
            return x * 2

    seen: list = []
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Probe()), balance=[1, 1], chunks=2)
    pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
    assert seen and all(task is None and same for task, same in seen)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["never", "always"])
def test_inner_checkpoint_on_a_shared_gpu(mode):
    # Two stages on cuda:0: Pipe.forward's backward runs them on the device thread, where
    # the runner makes each task current; the CUDA stream state is the task's, not cuda:0's.
    def grads(inner):
        torch.manual_seed(0)
        model = nn.Sequential(Block(inner, False), Block(inner, False))
        pipe = Pipe(model, balance=[1, 1], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=mode)
        torch.manual_seed(1)
        x = torch.randn(8, 8, device="cuda:0", requires_grad=True)
        out = pipe(x)
        out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in pipe.parameters())]

    want, got = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert (want[0] == 0).any()


def test_a_fork_outside_any_task_holds_the_generator_locks():
    """A recompute on a thread without a task (autograd's device thread) restores and draws from the
    default generators; the stage workers swap those under the same locks, so none can draw in between."""
    import threading

    import fastpipe  # noqa: F401 - installs the task-aware RNG-state functions
    from fastpipe.rng.streams import device_lock

    def free_elsewhere() -> bool:
        got: list[bool] = []

        def probe() -> None:
            lock = device_lock(torch.device("cpu"))
            ok = lock.acquire(blocking=False)
            if ok:
                lock.release()
            got.append(ok)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return got[0]

    assert free_elsewhere()
    with torch.random.fork_rng(devices=[]):
        assert not free_elsewhere()
        torch.rand(2)
    assert free_elsewhere()
