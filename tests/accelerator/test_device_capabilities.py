"""fastpipe on an accelerator other than CUDA: the capability table's generic path.

CUDA takes fastpipe._C's stream path; every other accelerator type (XPU, MPS, PrivateUse1
backends, the emulated device here) uses torch's own copies and no stream handling. Device
names resolve to explicit indices, as autograd's engine needs, and an index the accelerator
does not have is named when the Pipe is built.
"""

import pytest
import torch
from torch import nn

import fastpipe._C as _C
from fastpipe import Pipe
from fastpipe.runtime import device as dev
from fastpipe.runtime.transfer import pending_count, start_transfer


def test_only_cuda_takes_the_stream_path():
    assert dev.capabilities("cuda:0") == dev.capabilities(0)
    assert dev.capabilities("cuda").streams
    assert dev.capabilities("cuda").c_copies == dev.capabilities("cuda").pinned == _C.backend_available("cuda")
    for kind in ("cpu", "xpu", "mps", "meta"):
        caps = dev.capabilities(kind)
        assert not (caps.streams or caps.c_copies or caps.pinned), kind
    assert dev.backend_for("xpu:0") == "host"


def test_the_emulated_device_takes_the_generic_path(emu):
    assert dev.capabilities(emu) == dev.capabilities("xpu")
    x = torch.randn(3, 5)
    before = pending_count()
    to_device = start_transfer(x, emu)
    assert to_device.done() and pending_count() == before  # torch's copy, nothing in flight in _C
    on_device = to_device.wait()
    assert on_device.device == emu and torch.equal(on_device.cpu(), x)
    back = start_transfer(on_device, "cpu").wait()
    assert back.device.type == "cpu" and torch.equal(back, x)


def test_a_bare_accelerator_name_gets_its_index(emu):
    # A bare "emu" would reach autograd's engine without an index, and trip its assert.
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], devices=["emu", "emu"], chunks=2)
    assert pipe.devices == [emu, emu]
    pipe(torch.randn(4, 4)).sum().backward()
    assert all(p.grad.device == emu for p in pipe.parameters())


def test_an_index_the_accelerator_lacks_is_named(emu):
    with pytest.raises(ValueError, match=r"asks for emu:1, but torch.emu.is_available\(\) is True and "):
        Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], devices=["emu:0", "emu:1"])
