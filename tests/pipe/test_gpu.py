"""Pipe on CUDA: stages sharing one GPU, and stages split between CPU and GPU."""

import copy

import pytest
import torch
from torch import nn

from fastpipe import Pipe

pytestmark = pytest.mark.gpu


def model(p=0.1):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Dropout(p), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)
    )


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_transparency_on_gpu(devices, checkpoint):
    net = model(p=0.0)  # training mode, so checkpointed stages really recompute on the GPU
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[3, 3], devices=devices, chunks=4, checkpoint=checkpoint)
    x = torch.randn(16, 32)
    out = pipe(x.to(devices[0]))
    assert out.device == torch.device(devices[-1])
    out_ref = ref(x.cuda())
    torch.testing.assert_close(out.cuda(), out_ref, rtol=1e-4, atol=1e-5)
    out.float().square().sum().backward()
    out_ref.square().sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cuda(), q.grad, rtol=1e-3, atol=1e-4)


def test_dropout_reproducible_on_gpu():
    def run(checkpoint):
        pipe = Pipe(model(), balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(5)
        out = pipe(torch.randn(16, 32, device="cuda"))
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in pipe.parameters()]

    a, b = run("never"), run("always")
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_train_step_on_gpu(schedule):
    net = model(p=0.0)
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4)
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
    loss_ref = nn.functional.mse_loss(ref(x), y)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)


def test_autocast_on_gpu():
    pipe = Pipe(model(), balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(torch.randn(8, 32, device="cuda"))
    assert out.dtype == torch.bfloat16


# -- the device-thread backward (runtime.inline) and what CUDA stages must get right -----


def grads_of(module):
    return [p.grad for p in module.parameters()]


def accumulate_plain(ref, x, chunks, loss_fn):
    """The plain model over the same micro-batches, gradients accumulated: the same ops."""
    outs = []
    for mb in x.chunk(chunks):
        out = ref(mb)
        (loss_fn(out) * (mb.size(0) / x.size(0))).backward()
        outs.append(out.detach())
    return torch.cat(outs)


@pytest.mark.parametrize(
    "devices",
    [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"], ["cuda:0", "cpu", "cuda:0"], ["cpu", "cuda:0", "cpu"]],
)
def test_gpu_stages_backward_on_the_device_thread(devices, autograd_threads):
    # No stage worker may call autograd for a CUDA stage when the node runs on the
    # device thread (the grad arrives on CUDA): that is what deadlocked.
    balance = [2, 2, 2] if len(devices) == 3 else [3, 3]
    pipe = Pipe(model(p=0.0), balance=balance, devices=devices, chunks=4)
    out = pipe(torch.randn(16, 32, device=devices[0]))
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    workers = {n for n in autograd_threads if n.startswith("fastpipe-worker-")}
    if devices[-1].startswith("cuda"):
        assert workers == {f"fastpipe-worker-{s}" for s, d in enumerate(devices) if d == "cpu"}
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_autocast_bf16_backward(checkpoint):
    net = model(p=0.0)
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
    x = torch.randn(16, 32, device="cuda")

    def loss_fn(out):
        return out.float().square().mean()

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(x)
        assert out.dtype == torch.bfloat16
        loss_fn(out).backward()
        out_ref = accumulate_plain(ref, x, 4, loss_fn)
    # The same bf16 ops on the same micro-batches; tolerances of bf16 (8 bits of mantissa).
    torch.testing.assert_close(out, out_ref, rtol=1.6e-2, atol=1e-2)
    for g, q in zip(grads_of(pipe), grads_of(ref)):
        torch.testing.assert_close(g, q, rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_on_gpu(checkpoint):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(
        net, balance=[2, 2], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
    )
    for step in range(2):
        x = torch.randn(32, 8, device="cuda") * (step + 1)
        pipe(x).sum().backward()
        ref(x)  # running statistics of one full-batch pass
    torch.testing.assert_close(pipe[2].running_mean, ref[2].running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pipe[2].running_var, ref[2].running_var, rtol=1e-4, atol=1e-5)
    assert int(pipe[2].num_batches_tracked) == 2
    assert all(torch.isfinite(p.grad).all() for p in pipe.parameters())


def test_input_grad_on_the_inputs_device():
    net = model(p=0.0)
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4)
    x = torch.randn(16, 32, requires_grad=True)  # on CPU; stage 0 is on cuda:0
    xr = x.detach().clone().requires_grad_()
    pipe(x).sum().backward()
    ref(xr).sum().backward()
    assert x.grad.device.type == "cpu"
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0", "cpu"]])
def test_train_step_moves_targets_to_the_last_stage(devices):
    net = model(p=0.0)
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[3, 3], devices=devices, chunks=4)
    x, y = torch.randn(16, 32), torch.randn(16, 8)  # both on CPU
    loss = pipe.train_step(x.to(devices[0]), y if devices[-1] == "cuda:0" else y.cuda(), nn.MSELoss())
    loss_ref = nn.functional.mse_loss(ref(x), y)
    loss_ref.backward()
    torch.testing.assert_close(loss.cpu(), loss_ref.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4)


class Where(nn.Module):
    """Records where new tensors land and which stream runs, inside a stage."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.arange(2).device, torch.cuda.current_stream(x.device)))
        return x


def test_default_device_and_stream_reach_the_stages():
    probe = Where()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), probe), balance=[1, 1], devices=["cuda:0", "cuda:0"], chunks=2)
    stream = torch.cuda.Stream()
    torch.set_default_device("cuda")
    try:
        with torch.no_grad(), torch.cuda.stream(stream):
            out = pipe(torch.randn(4, 4, device="cuda"))
        stream.synchronize()
    finally:
        torch.set_default_device(None)
    assert out.shape == (4, 4)
    assert {d for d, _ in probe.seen} == {torch.device("cuda", 0)}
    assert {s for _, s in probe.seen} == {stream}


def test_no_missing_cuda_context_warning(tmp_path):
    # A fresh process: torch warns once per process, so earlier tests could hide it.
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom fastpipe import Pipe\n"
        "net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 8))\n"
        "pipe = Pipe(net, balance=[2, 2], devices=['cuda:0', 'cuda:0'], chunks=4)\n"
        "x = torch.randn(32, 64, device='cuda')\n"
        "pipe(x).sum().backward()\n"
        "pipe.train_step(x, torch.randn(32, 8, device='cuda'), nn.MSELoss())\n"
        "torch.cuda.synchronize()\nprint('done')\n"
    )
    proc = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "no current CUDA context" not in proc.stderr


def test_peer_access_is_enabled_or_refused_cleanly():
    import fastpipe._C as _C

    assert _C.cuda_enable_peer_access(0, 0)
    if torch.cuda.device_count() > 1:
        assert _C.cuda_enable_peer_access(0, 1) == torch.cuda.can_device_access_peer(0, 1)


def test_auto_balance_profiles_on_the_gpu():
    class Seen(nn.Linear):
        devices = []

        def forward(self, x):
            Seen.devices.append(self.weight.device.type)
            return super().forward(x)

    net = nn.Sequential(Seen(16, 16), nn.ReLU(), Seen(16, 16), nn.ReLU())  # built on the CPU
    pipe = Pipe(net, balance="auto", devices=["cuda:0", "cuda:0"], chunks=2, sample=torch.randn(8, 16))
    assert set(Seen.devices) == {"cuda"}  # profiled where it runs, not where it sat
    assert sum(pipe.balance) == 4
