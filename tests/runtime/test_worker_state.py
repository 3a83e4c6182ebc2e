"""What workers take over from the caller besides grad mode and autocast (CallerState)."""

import threading

import torch

from fastpipe.runtime.autograd_node import join_input_grads
from fastpipe.runtime.worker import CallerState


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


def test_default_device_reaches_a_worker_thread():
    # torch.set_default_device is thread-local: without CallerState a stage's
    # torch.arange(n) would land on the CPU.
    torch.set_default_device("meta")
    try:
        caller = CallerState.capture()
    finally:
        torch.set_default_device(None)
    assert in_thread(lambda: torch.empty(1).device).type == "cpu"

    def stage():
        with caller.placed(torch.device("cpu")):
            return torch.arange(3).device

    assert in_thread(stage).type == "meta"
    assert in_thread(lambda: torch.empty(1).device).type == "cpu"  # left as it was


def test_plain_cpu_caller_costs_nothing():
    caller = CallerState.capture()
    assert caller.default_device == torch.device("cpu") and caller.streams == ()
    with caller.placed(torch.device("cpu")):
        assert torch.empty(1).device.type == "cpu"


def test_input_grads_go_to_each_inputs_device():
    # Stage 0 computes them on its device; autograd wants them where the inputs live.
    per_mb = [[torch.ones(2, 3), None], [torch.ones(1, 3), None]]
    joined = join_input_grads(per_mb, [torch.device("meta"), torch.device("cpu")])
    assert joined[0].device.type == "meta" and joined[0].shape == (3, 3)
    assert joined[1] is None
    partial = join_input_grads([[torch.ones(2)], [None]], [torch.device("cpu")])
    assert partial == [None]  # a micro-batch without a gradient: the input gets none
