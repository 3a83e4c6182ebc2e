"""Activation offload on the emulated accelerator: fewer device bytes, the same gradients bit for bit.

The emulated device (tests/emulated_device.py) takes the capability table's generic path: torch's
own copies to host memory and back. Its backward runs on autograd's device thread, as on CUDA, so
the saved tensors come back on that thread; its byte counter is the device's allocator here.
"""

import gc

import emulated_device
import pytest
import torch
from torch import nn

import fastpipe.runtime.device as device_table
from fastpipe import Pipe
from fastpipe.runtime.host_copies import CopyPath, HostMemoryError

SCHEDULES = [("gpipe", 1, [4, 4]), ("1f1b", 1, [4, 4]), ("zb-h1", 1, [4, 4]), ("zb-v", 2, [2, 2, 2, 2])]


def model(width=32, blocks=2):
    torch.manual_seed(0)
    return nn.Sequential(
        *[m for _ in range(blocks) for m in (nn.Linear(8, width), nn.GELU(), nn.Linear(width, 8), nn.Tanh())]
    )


def grads(pipe):
    return [p.grad.cpu() for p in pipe.parameters()]


class Sent:
    """Bytes sent to the host."""

    def __init__(self, monkeypatch):
        self.nbytes = 0
        original = CopyPath.to_host

        def to_host(path, t):
            self.nbytes += t.numel() * t.element_size()
            return original(path, t)

        monkeypatch.setattr(CopyPath, "to_host", to_host)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("name, virtual, balance", SCHEDULES)
def test_offload_on_a_device_leaves_gradients_bitwise_equal(name, virtual, balance, checkpoint, emu, monkeypatch):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    kw = dict(balance=balance, devices=[emu] * len(balance), chunks=4, checkpoint=checkpoint, schedule=name)
    kw["virtual_stages"] = virtual
    plain = Pipe(model(), **kw)
    loss = plain.train_step(x, y, nn.MSELoss())
    sent = Sent(monkeypatch)
    pipe = Pipe(model(), offload=1.0, **kw)
    assert torch.equal(loss.cpu(), pipe.train_step(x, y, nn.MSELoss()).cpu())
    if checkpoint == "never" or name.startswith("zb"):  # see tests/runtime/test_offload.py
        assert sent.nbytes > 0
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)
    del plain, pipe, loss


def test_autograd_backward_on_the_device_thread_brings_offloaded_tensors_back(emu, monkeypatch):
    x = torch.randn(16, 8)
    plain = Pipe(model(), balance=[4, 4], devices=[emu, emu], chunks=4, checkpoint="never")
    emulated_device.backward(plain(x).square().sum())
    sent = Sent(monkeypatch)
    pipe = Pipe(model(), balance=[4, 4], devices=[emu, emu], chunks=4, checkpoint="never", offload=0.5)
    emulated_device.backward(pipe(x).square().sum())
    assert sent.nbytes > 0
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)
    del plain, pipe


def test_offload_lowers_the_counted_device_peak_by_the_offloaded_share(emu, monkeypatch):
    # One stage under gpipe, 8 micro-batches: 0F0 ... 0F6 [0P5] 0F7 [0P6] 0BW7 ... Micro-batch 7 does
    # not offload (its backward follows its forward), and 6 comes back during F7, so at the peak, the
    # end of the forwards, six micro-batches' offloaded bytes are in host memory.
    x, y = torch.randn(512, 8), torch.randn(512, 8)
    peaks, offloaded, grads_of = {}, {}, {}
    for fraction in (0.0, 0.5, 1.0):
        pipe = Pipe(
            model(256, 3), [12], devices=[emu], chunks=8, checkpoint="never", schedule="gpipe", offload=fraction
        )
        pipe.train_step(x, y, nn.MSELoss())  # the gradients' sums exist from here on
        gc.collect()
        emulated_device.reset_peak()
        start, _ = emulated_device.memory_stats()
        sent = Sent(monkeypatch)
        pipe.train_step(x, y, nn.MSELoss())
        _, peak = emulated_device.memory_stats()
        peaks[fraction], offloaded[fraction] = peak - start, sent.nbytes / 7  # per offloading micro-batch
        grads_of[fraction] = grads(pipe)
        monkeypatch.undo()
        del pipe
    assert offloaded[0.0] == 0 and 0 < offloaded[0.5] < offloaded[1.0]
    for fraction in (0.5, 1.0):
        assert all(torch.equal(a, b) for a, b in zip(grads_of[0.0], grads_of[fraction]))
    for fraction in (0.5, 1.0):
        saved = peaks[0.0] - peaks[fraction]
        assert 0.85 * 6 * offloaded[fraction] <= saved <= 1.05 * 6 * offloaded[fraction], (fraction, peaks, offloaded)


def test_a_device_whose_host_has_no_page_locked_memory_is_refused_when_the_pipe_is_built(emu, monkeypatch):
    def no_pinned(pinned):
        raise RuntimeError("cuMemHostAlloc failed: out of locked memory")

    pinned_row = device_table.Capabilities(streams=False, c_copies=False, pinned=True)
    monkeypatch.setattr(device_table, "capabilities", lambda d: pinned_row)
    monkeypatch.setattr(device_table, "host_pool", no_pinned)
    with pytest.raises(HostMemoryError, match="page-locked .*out of locked memory.*offload=0"):
        Pipe(model(), balance=[4, 4], devices=[emu, emu], chunks=2, offload=0.5)
