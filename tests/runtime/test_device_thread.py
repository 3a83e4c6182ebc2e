"""The backward that GPU stages take (runtime.inline), forced on CPU stages.

On a GPU, ``Pipe``'s backward node runs on autograd's device thread, and a stage worker
that called autograd on that device's tensors would deadlock. There the calling thread
runs the GPU stages' backward itself. ``LocalRuntime``'s ``simulated_device_stages`` makes a
CPU run take that path for the named stages, so these tests check that it gives the very
numbers of the threaded path, that no worker of a "GPU" stage ever calls autograd, and
that failures inside it neither hang nor leak threads.
"""

import copy
import gc
import threading

import pytest
import torch
from torch import nn

from fastpipe import DeferredBatchNorm, Pipe
from fastpipe.runtime import inline
from fastpipe.runtime.threads import LocalRuntime
from fastpipe.runtime.worker import live_worker_threads
from fastpipe.schedule.builders import build_for


def model(p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24),
        nn.GELU(),
        nn.Dropout(p),
        nn.Linear(24, 24),
        nn.LayerNorm(24),
        nn.Tanh(),
        nn.Linear(24, 24),
        nn.ReLU(),
        nn.Linear(24, 6),
    )


BALANCE = {2: [4, 5], 3: [3, 3, 3]}


def simulated(pipe, stages):
    """Run ``stages`` ("all" or "0,2") of ``pipe`` as if on a GPU, on the device-thread path."""
    n = len(pipe.balance)
    pipe.runtime.simulated_device_stages = (
        frozenset(range(n)) if stages == "all" else frozenset(int(s) for s in stages.split(","))
    )
    return pipe


def run(net, stages, checkpoint, simulate, x, balance=None, **kwargs):
    pipe = Pipe(net, balance=balance or BALANCE[stages], chunks=4, checkpoint=checkpoint, **kwargs)
    if simulate is not None:
        simulated(pipe, simulate)
    xp = x.clone().requires_grad_()
    out = pipe(xp)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), xp.grad, [p.grad for p in pipe.parameters()], pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages,simulate", [(2, "all"), (2, "1"), (2, "0"), (3, "0,2"), (3, "1")])
def test_same_numbers_as_threaded_path(stages, simulate, checkpoint, autograd_threads):
    x = torch.randn(16, 12)
    out, gx, grads, _ = run(model(0.2), stages, checkpoint, None, x)
    threaded = set(autograd_threads) - {threading.current_thread().name}  # less the test's own backward()
    autograd_threads.clear()
    out2, gx2, grads2, _ = run(model(0.2), stages, checkpoint, simulate, x)
    # The same handlers on the same data in the same per-stage order: the same bits.
    assert torch.equal(out, out2) and torch.equal(gx, gx2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)
    on_device = set(range(stages)) if simulate == "all" else {int(s) for s in simulate.split(",")}
    assert threaded == {f"fastpipe-worker-{s}" for s in range(stages)}
    # No worker of a "GPU" stage called autograd; CPU stages kept their own threads.
    assert set(autograd_threads) - {threading.current_thread().name} == {
        f"fastpipe-worker-{s}" for s in range(stages) if s not in on_device
    }


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_matches_plain_model(checkpoint):
    net = model()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 12)
    out, gx, grads, _ = run(net, 2, checkpoint, "all", x)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    (out_ref * torch.linspace(-1, 1, out_ref.numel()).view_as(out_ref)).sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_autocast_and_deferred_batch_norm():
    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
        )

    x = torch.randn(16, 12)
    results = []
    for simulate in (None, "all"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, gx, grads, pipe = run(net(), 2, "except_last", simulate, x, balance=[3, 3], deferred_batch_norm=True)
        assert out.dtype == torch.bfloat16
        stats = [b.running_mean.clone() for b in pipe.modules() if isinstance(b, DeferredBatchNorm)]
        results.append((out, gx, grads, stats))
    (a, b) = results
    for u, v in zip([a[0], a[1], *a[2], *a[3]], [b[0], b[1], *b[2], *b[3]]):
        assert torch.equal(u, v)


def test_split_backward_schedule_inline(autograd_threads):
    # Pipe.forward runs GPipe; the inline runner also takes zero-bubble's B and W.
    net = model()
    ref = copy.deepcopy(net)
    pipe = simulated(Pipe(net, balance=[4, 5], chunks=4, checkpoint="never"), "all")
    runtime, mbs = pipe.runtime, list(torch.randn(16, 12).chunk(4))
    schedule = build_for("zb-h1", 2, 2, 4)
    from fastpipe.runtime.worker import CallerState

    outs, state = runtime.forward(
        schedule, mbs, grad=True, checkpoint=lambda m: False, caller=CallerState.capture(), step_seed=1
    )
    _, grads = runtime.backward(state, [[torch.ones_like(o)] for o in outs])
    assert not any(n.startswith("fastpipe-worker") for n in autograd_threads)
    ref(torch.cat(mbs)).sum().backward()
    flat = [g for stage in grads for g in stage]
    for g, p in zip(flat, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


class Boom(nn.Module):
    def __init__(self, when):
        super().__init__()
        self.when = when

    def forward(self, x):
        return _Fail.apply(x) if self.when == "backward" else x


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


@pytest.mark.parametrize("failing,simulate", [(1, "all"), (0, "all"), (1, "1"), (0, "1"), (1, "0")])
def test_failure_inside_inline_backward(failing, simulate):
    gc.collect()  # earlier tests' pipes stop their workers when collected
    before = live_worker_threads()
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers.insert(1 if failing == 0 else 3, Boom("backward"))
    pipe = simulated(Pipe(nn.Sequential(*layers), balance=[2, 2], chunks=4), simulate)
    for _ in range(2):  # the pipe stays usable after a failure
        out = pipe(torch.randn(8, 4))
        with pytest.raises(ValueError, match="boom in backward") as info:
            out.sum().backward()
        assert f"stage {failing}" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    pipe.close()
    assert live_worker_threads() == before


def test_backward_from_another_thread(autograd_threads):
    # The thread that runs the node plays autograd's device thread.
    pipe = simulated(Pipe(model(), balance=[4, 5], chunks=4), "all")
    out = pipe(torch.randn(16, 12))
    errors = []

    def backward():
        try:
            out.sum().backward()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=backward, name="device-thread")
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and not errors
    assert set(autograd_threads) == {"device-thread"}  # its backward() and every stage's
    assert all(p.grad is not None for p in pipe.parameters())


def test_switch_is_validated():
    stages = Pipe(model(), balance=[4, 5]).runtime.stages
    with pytest.raises(ValueError, match="outside 0..1"):
        LocalRuntime(stages, simulated_device_stages={5})


def test_only_device_stage_workers_inline():
    schedule = build_for("gpipe", 3, 3, 4)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert inline.inline_workers(schedule, [cpu, gpu, cpu], on_device_thread=True) == {1}
    assert inline.inline_workers(schedule, [gpu, gpu, cpu], on_device_thread=False) == set()
    assert inline.inline_workers(schedule, [cpu, cpu, cpu], on_device_thread=True) == set()
