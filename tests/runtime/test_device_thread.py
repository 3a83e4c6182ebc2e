"""The backward that accelerator stages take (runtime.inline), on autograd's real device thread.

On an accelerator, ``Pipe``'s backward node runs on autograd's engine thread of its gradients'
device, and a stage worker that called autograd on that device's tensors would deadlock.
There the engine thread runs the backward of that device's stages itself. The emulated
device (tests/emulated_device.py, the ``emu`` fixture) has such an engine thread, so these
tests check, with torch's own routing, that this path gives the very numbers of the CPU
pipe (and those of the plain model, to rounding), that no worker of a device stage calls
autograd while the node runs on the device thread, and that failures inside it neither
hang nor leak threads. Which workers run inline for several GPUs is checked on the
decision itself (``inline_workers``), as there is one emulated device.
"""

import gc
import threading

import emulated_device
import pytest
import torch
from _seeded_reference import seeded_forward, step_seed_after
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import DeferredBatchNorm, Pipe
from fastpipe.runtime import inline
from fastpipe.runtime.autograd_node import NodeRun, PipelineNode
from fastpipe.runtime.worker import CallerState, live_worker_threads
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
STEP = 7
# Reductions from input to output (the widths) plus the rows a weight gradient sums over.
K = 12 + 4 * 24 + 16
PLACEMENTS = ["emu,emu", "cpu,emu", "emu,cpu", "emu,emu,emu", "cpu,emu,cpu", "emu,cpu,emu"]


def devices(placement, emu):
    return [emu if p == "emu" else torch.device("cpu") for p in placement.split(",")]


def run(net, devs, checkpoint, x, balance=None, **kwargs):
    """Forward and backward through a Pipe on ``devs``; results on the CPU."""
    pipe = Pipe(net, balance=balance or BALANCE[len(devs)], devices=devs, chunks=4, checkpoint=checkpoint, **kwargs)
    xp = x.clone().to(devs[0]).requires_grad_()
    torch.manual_seed(STEP)  # the step's seed is the first draw after it
    out = pipe(xp)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out).to(out.device)
    emulated_device.backward((out * weights).sum())
    return out.detach().cpu(), xp.grad.cpu(), [p.grad.cpu() for p in pipe.parameters()], pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_same_numbers_as_cpu_pipe(placement, checkpoint, emu, autograd_threads):
    # An emu tensor is a subclass, so its Linears leave their weight GEMMs to autograd; the CPU
    # pipe's deferred ones must then run one GEMM per micro-batch too, not batched, for the same bits.
    x = torch.randn(16, 12)
    devs = devices(placement, emu)
    out, gx, grads, _ = run(model(0.2), [torch.device("cpu")] * len(devs), checkpoint, x, wgrad_batch=1)
    autograd_threads.clear()
    out2, gx2, grads2, _ = run(model(0.2), devs, checkpoint, x, wgrad_batch=1)
    # The same handlers on the same data in the same per-stage order, and the same task
    # streams for dropout (emu ops draw from the CPU generator): the same bits.
    assert torch.equal(out, out2) and torch.equal(gx, gx2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)
    callers = set(autograd_threads) - {"test-backward"}
    workers = {f"fastpipe-worker-{s}" for s, d in enumerate(devs) if d.type == "cpu" or devs[-1].type == "cpu"}
    if devs[-1].type == "cpu":
        # The node got CPU gradients and ran on the caller's thread: every stage in its worker,
        # the device stages' autograd queued to the (free) device thread.
        assert callers == workers
    else:
        # On the device thread, which ran the device stages' backward itself.
        device_threads = {n for n in callers if n.startswith("Dummy")}
        assert len(device_threads) == 1 and callers - device_threads == workers
    # And the plain model, run micro-batch by micro-batch with the tasks' seeds.
    ref = model(0.2)
    xr = x.clone().requires_grad_()
    out_ref = torch.cat(seeded_forward(ref, BALANCE[len(devs)], xr, 4, step_seed_after(STEP)))
    (out_ref * torch.linspace(-1, 1, out_ref.numel()).view_as(out_ref)).sum().backward()
    assert_close_reordered(out2, out_ref.detach(), k=K)
    assert_close_reordered(gx2, xr.grad, k=K)
    for g, p in zip(grads2, ref.parameters()):
        assert_close_reordered(g, p.grad, k=K)


def test_autocast_and_deferred_batch_norm(emu):
    # The caller's autocast reaches the workers and the device thread alike; on both devices
    # it casts the Linears only: the same bits as the CPU pipe (the statistics, reduced in
    # fp32 by kernels that may group the sums differently, to rounding).
    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
        )

    x = torch.randn(16, 12)
    results = []
    for devs in ([torch.device("cpu")] * 2, [emu, emu]):
        with torch.autocast(devs[0].type, dtype=torch.bfloat16):
            out, gx, grads, pipe = run(net(), devs, "except_last", x, balance=[3, 3], deferred_batch_norm=True)
        assert out.dtype == torch.bfloat16
        stats = [b.running_mean.cpu() for b in pipe.modules() if isinstance(b, DeferredBatchNorm)]
        results.append((out, gx, grads, stats))
    (a, b) = results
    for u, v in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        assert torch.equal(u, v)
    for u, v in zip(a[3], b[3]):
        assert_close_reordered(v, u, k=16)


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_split_backward_schedule_on_the_device_thread(name, emu, autograd_threads):
    # Pipe.forward runs GPipe; the node's inline runner also takes zero-bubble's B and W.
    net = model()
    ref = model()
    pipe = Pipe(net, balance=[4, 5], devices=[emu, emu], chunks=4, checkpoint="never")
    x = torch.randn(16, 12)
    xe = x.to(emu)
    params = list(pipe.parameters())
    noop = lambda: None  # noqa: E731
    mbs = list(xe.chunk(4))
    node = NodeRun(pipe.runtime, noop, build_for(name, 2, 2, 4), mbs, lambda m: False, CallerState.capture(), 1, [emu])
    outs = PipelineNode.apply(node, xe, *params)
    emulated_device.backward(outs[0].sum())
    assert not any(n.startswith("fastpipe-worker") for n in autograd_threads)
    ref(x).sum().backward()
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


class Boom(nn.Module):
    def forward(self, x):
        return _Fail.apply(x)


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


@pytest.mark.parametrize(
    "failing,placement", [(1, "emu,emu"), (0, "emu,emu"), (1, "cpu,emu"), (0, "cpu,emu"), (1, "emu,cpu")]
)
def test_failure_inside_inline_backward(failing, placement, emu):
    gc.collect()  # earlier tests' pipes stop their workers when collected
    before = live_worker_threads()
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers.insert(1 if failing == 0 else 3, Boom())
    pipe = Pipe(nn.Sequential(*layers), balance=[2, 2], devices=devices(placement, emu), chunks=4)
    for _ in range(2):  # the pipe stays usable after a failure
        out = pipe(torch.randn(8, 4))
        with pytest.raises(ValueError, match="boom in backward") as info:
            emulated_device.backward(out.sum())
        assert f"stage {failing}" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    pipe.close()
    del pipe, out, info
    assert live_worker_threads() == before


def test_backward_from_the_main_thread(emu, autograd_threads):
    # Plain loss.backward() from the test's own thread (the helper thread elsewhere).
    pipe = Pipe(model(), balance=[4, 5], devices=[emu, emu], chunks=4)
    out = pipe(torch.randn(16, 12))
    out.sum().backward()
    assert threading.current_thread().name in autograd_threads
    assert not any(n.startswith("fastpipe-worker") for n in autograd_threads)
    assert all(p.grad is not None and p.grad.device == emu for p in pipe.parameters())


def test_only_the_thread_devices_workers_inline():
    schedule = build_for("gpipe", 3, 3, 4)
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert inline.inline_workers(schedule, [cpu, gpu0, cpu], gpu0) == {1}
    assert inline.inline_workers(schedule, [gpu0, gpu0, cpu], None) == set()
    assert inline.inline_workers(schedule, [cpu, cpu, cpu], cpu) == set()
    # Several GPUs: only the stages on the node's own device run on its engine thread; the
    # other GPUs' workers keep their threads, their autograd going to their own engine threads.
    assert inline.inline_workers(schedule, [gpu0, gpu1, gpu0], gpu0) == {0, 2}
    assert inline.inline_workers(schedule, [gpu0, gpu1, gpu1], gpu1) == {1, 2}
    assert inline.inline_workers(schedule, [gpu1, gpu1, gpu1], gpu0) == set()
    # Interleaved: a worker with any stage on the thread's device runs inline.
    interleaved = build_for("interleaved", 4, 2, 4)
    assert inline.inline_workers(interleaved, [gpu0, gpu1, gpu1, gpu1], gpu0) == {0}
