"""The emulated accelerator routes autograd like CUDA, and so reproduces the device-thread deadlock.

A node whose backward waits for another thread that runs autograd on the same device's
tensors deadlocks on a GPU: the other thread's nodes are queued to the engine thread that
the waiting node occupies. The design fastpipe had before its inline device-thread backward
(every stage's backward in its worker, the node waiting for them) deadlocked exactly so on an
H200. These tests show the emulated device has that routing, reproduce the deadlock in a
child process (where a stuck thread harms nothing), and run a Pipe through the same shape.
"""

import os
import subprocess
import sys
import threading

import emulated_device
import pytest
import torch
from torch import nn

from fastpipe import Pipe

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)

# The deadlock in a dozen lines: the backward of Waits waits (at most ``wait`` s) for a
# thread that runs a backward of its own on the same device.
REPRODUCTION = """
import threading, torch

def waiting_backward(device, wait):
    class Waits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            w = torch.ones(3, device=g.device, requires_grad=True)
            other = threading.Thread(target=lambda: torch.autograd.grad((w * 2).sum(), w), daemon=True)
            other.start()
            other.join(wait)
            outcome.append("deadlocked" if other.is_alive() else "finished")
            return g

    outcome = []
    x = torch.ones(3, device=device, requires_grad=True)
    Waits.apply(x).sum().backward()
    return outcome[0]
"""

# The child leaves with os._exit: its engine thread is still stuck, and a normal interpreter
# exit would tear that C++ thread down and abort ("terminate called without an active exception").
CHILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
import emulated_device
emulated_device.register()
print(waiting_backward(emulated_device.device(), float(sys.argv[2])), flush=True)
os._exit(0)
"""


def test_a_backward_waiting_for_another_threads_backward_deadlocks_on_the_device(emu):
    # On the CPU the waiting node runs on the caller's thread and the other thread's
    # backward on that other thread: it finishes.
    scope: dict = {}
    exec(REPRODUCTION, scope)
    assert scope["waiting_backward"](torch.device("cpu"), 10.0) == "finished"
    # On the device both belong to the device's one engine thread: it cannot. In a child
    # process, so that nothing here waits behind it.
    proc = subprocess.run(
        [sys.executable, "-c", REPRODUCTION + CHILD, TESTS, "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "deadlocked"


class Waits(nn.Module):
    """A layer whose backward records the thread it runs on."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        return _Record.apply(x, self.seen)


class _Record(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(threading.current_thread().name)
        return g, None


def test_a_pipe_on_the_device_does_not_deadlock(emu):
    # The same shape: Pipe's node waits for its stages' backward; here they all live on the
    # node's device, so they must not run in the workers that the node waits for.
    seen: list[str] = []
    net = nn.Sequential(nn.Linear(4, 4), Waits(seen), nn.Linear(4, 4), Waits(seen))
    pipe = Pipe(net, balance=[2, 2], devices=[emu, emu], chunks=2)
    out = pipe(torch.randn(4, 4))
    emulated_device.backward(out.sum(), timeout=20)
    assert len(seen) == 4 and not any(n.startswith("fastpipe-worker") for n in seen)
    assert all(p.grad is not None and p.grad.device == emu for p in pipe.parameters())


def test_a_custom_functions_backward_runs_on_the_device_thread(emu):
    seen: list[str] = []
    x = torch.randn(3, device=emu, requires_grad=True)
    _Record.apply(x, seen).sum().backward()
    assert seen and seen[0] != threading.current_thread().name
    seen.clear()
    y = torch.randn(3, requires_grad=True)
    _Record.apply(y, seen).sum().backward()
    assert seen == [threading.current_thread().name]


def test_tensors_compute_on_the_cpu_and_stay_on_the_device(emu):
    x = torch.randn(4, 3)
    layer = nn.Linear(3, 2)
    want = layer(x)
    layer.to(emu)
    got = layer(x.to(emu))
    assert got.device == emu and layer.weight.device == emu
    assert type(got.cpu()) is torch.Tensor and torch.equal(got.detach().cpu(), want.detach())
    # A mix of devices raises, as it would on a GPU; a CPU scalar does not.
    with pytest.raises(RuntimeError, match="same device"):
        got + torch.ones(4, 2)
    assert (got + torch.tensor(1.0)).device == emu


def test_manual_seed_governs_the_devices_draws(emu):
    torch.manual_seed(5)
    a = torch.randn(8, device=emu)
    mask = torch.nn.functional.dropout(torch.ones(8, device=emu), 0.5)
    torch.manual_seed(5)
    assert torch.equal(a.cpu(), torch.randn(8))
    assert torch.equal(mask.cpu(), torch.nn.functional.dropout(torch.ones(8), 0.5))


def test_autocast_on_the_device_runs_matrix_products_in_the_low_dtype(emu):
    x = torch.randn(4, 3, device=emu)
    layer = nn.Linear(3, 2).to(emu)
    with torch.autocast("emu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
        assert (x + 1).dtype == torch.float32
