"""Activation offload on the CPU: the runtime's own path through fastpipe._C's host backend.

A CPU stage gains nothing from offload, so ``Pipe(offload=...)`` leaves it alone (warned). These
tests set a forced policy on the stages instead: the saved tensors then go through the same
asynchronous copies as on a GPU (host copy streams, pooled blocks, events), and come back
through the schedule's ``P`` actions. The emulated accelerator runs the generic path
(tests/runtime/test_offload_emu.py).
"""

import threading
import warnings

import pytest
import torch
from torch import nn

import fastpipe.runtime.device as device_table
from fastpipe import Pipe
from fastpipe.memory.offload import FORMS, PipeOffload, resolve_offload
from fastpipe.runtime import host_copies
from fastpipe.runtime.host_copies import CopyPath, HostMemoryError, check_host_memory, pending_copies
from fastpipe.runtime.offload import OffloadPolicy, SavedSet, StepOffload, chosen_prefix
from fastpipe.schedule import build

CPU = torch.device("cpu")
SCHEDULES = [("gpipe", 1, [4, 4]), ("1f1b", 1, [4, 4]), ("zb-h1", 1, [4, 4]), ("zb-v", 2, [2, 2, 2, 2])]


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(2) for m in (nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Tanh())])


class Copies:
    """Counts the tensors that go to the host and the bytes they take."""

    def __init__(self, monkeypatch):
        self.count = self.nbytes = 0
        original = CopyPath.to_host

        def to_host(path, t):
            self.count += 1
            self.nbytes += t.numel() * t.element_size()
            return original(path, t)

        monkeypatch.setattr(CopyPath, "to_host", to_host)


def forced(pipe, fraction=0.5, layers=None):
    """Offload every stage of a CPU pipe through _C's host backend (what a GPU stage does)."""
    for stage in pipe._stages:
        stage.offload = OffloadPolicy(fraction, layers, force=True)
    return pipe


def grads(pipe):
    return [p.grad.clone() for p in pipe.parameters()]


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("name, virtual, balance", SCHEDULES)
def test_offload_leaves_gradients_bitwise_equal(name, virtual, balance, checkpoint, monkeypatch):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    kw = dict(balance=balance, chunks=4, checkpoint=checkpoint, schedule=name, virtual_stages=virtual)
    plain = Pipe(model(), **kw)
    loss = plain.train_step(x, y, nn.MSELoss())
    copies = Copies(monkeypatch)
    pipe = forced(Pipe(model(), trace=True, **kw), 1.0)
    loss_offloaded = pipe.train_step(x, y, nn.MSELoss())
    # Under except_last only the last micro-batch keeps its graph, and gpipe and 1f1b run its
    # backward right after its forward on stage 0: it gains nothing, so it does not offload.
    if checkpoint == "never" or name.startswith("zb"):
        assert copies.count > 0  # something went to the host and came back
        assert any(e.kind == "P" for e in pipe.last_timeline.events)
    assert torch.equal(loss, loss_offloaded)
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)


def test_pipe_forward_and_autograd_backward_bring_offloaded_tensors_back(monkeypatch):
    x = torch.randn(16, 8)
    plain = Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never")
    plain(x).square().sum().backward()
    copies = Copies(monkeypatch)
    pipe = forced(Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never"))
    pipe(x).square().sum().backward()
    assert copies.count > 0
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)


def test_a_backward_that_reads_before_its_prefetch_arrived_waits_for_it():
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    plain = Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never", schedule="gpipe")
    plain.train_step(x, y, nn.MSELoss())
    pipe = forced(Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never", schedule="gpipe"), 1.0)
    slow = threading.Event()
    original = CopyPath.to_device

    def to_device(path, host, like, after):
        device_table.copy_stream(path.device, "in").delay(0.02)  # every copy back lands late
        slow.set()
        return original(path, host, like, after)

    try:
        CopyPath.to_device = to_device  # type: ignore[method-assign]
        pipe.train_step(x, y, nn.MSELoss())
    finally:
        CopyPath.to_device = original  # type: ignore[method-assign]
    assert slow.is_set()
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)


def test_a_backward_without_its_prefetch_fetches_for_itself(monkeypatch):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    plain = Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never", schedule="gpipe")
    plain.train_step(x, y, nn.MSELoss())
    monkeypatch.setattr(StepOffload, "prefetch", lambda self, action: 0.0)
    copies = Copies(monkeypatch)
    pipe = forced(Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never", schedule="gpipe"), 1.0)
    pipe.train_step(x, y, nn.MSELoss())
    assert copies.count > 0
    for a, b in zip(grads(plain), grads(pipe)):
        assert torch.equal(a, b)


def test_only_the_micro_batches_the_schedule_prefetches_offload(monkeypatch):
    copies = Copies(monkeypatch)
    pipe = forced(Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never", schedule="1f1b"), 1.0)
    assert pipe._offload.prefetch(build("1f1b", 2, 4)).prefetched == {(0, 1), (0, 2)}  # stage 1 gains nothing
    pipe.train_step(torch.randn(16, 8), torch.randn(16, 8), nn.MSELoss())
    per_microbatch = copies.count // 2
    assert copies.count == 2 * per_microbatch and per_microbatch > 0


def test_a_layer_predicate_offloads_only_what_its_layers_save(monkeypatch):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    everything = Copies(monkeypatch)
    forced(Pipe(model(), balance=[8], chunks=4, checkpoint="never", schedule="gpipe"), 1.0).train_step(
        x, y, nn.MSELoss()
    )
    gelu_only = Copies(monkeypatch)
    forced(
        Pipe(model(), balance=[8], chunks=4, checkpoint="never", schedule="gpipe"), 1.0, frozenset({1, 5})
    ).train_step(x, y, nn.MSELoss())
    assert 0 < gelu_only.count < everything.count
    assert gelu_only.nbytes == gelu_only.count * 4 * 32 * 4  # a GELU saves its 4 x 32 input, nothing else


def test_a_tensor_changed_in_place_after_it_was_saved_is_refused_as_autograd_refuses_it():
    class Exp(nn.Module):
        def forward(self, x):
            return x.exp()  # saves its result

    class Bump(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x.add_(1) if self.calls == 1 else x  # changes micro-batch 0's result in place (offloaded)

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for offload, match in [(False, "modified by an inplace operation"), (True, "changed in place during the forward")]:
        pipe = Pipe(
            nn.Sequential(nn.Linear(8, 8), Exp(), Bump(), nn.Linear(8, 8)), balance=[4], chunks=2, checkpoint="never"
        )
        if offload:
            forced(pipe, 1.0)
        with pytest.raises(RuntimeError, match=match):
            pipe.train_step(x, y, nn.MSELoss(), schedule="gpipe")


def test_a_kept_tensor_changed_after_the_forward_is_refused_when_read():
    saved = SavedSet(CopyPath(CPU, force=True))
    x = torch.randn(4, 4, requires_grad=True)
    with saved.hooks():
        h = x * 2
        out = h.sin()  # saves h, which the caller keeps (so it stays on the device)
    assert saved.candidates() == []
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*version 1; expected version 0"):
        out.sum().backward()


def test_the_candidates_are_what_only_autograd_holds_in_the_order_saved():
    # torch's private counts (Tensor._use_count, the storage's use count) and sys.getrefcount
    # decide what only autograd holds; this pins what they say after a forward.
    saved = SavedSet(CopyPath(CPU, force=True))
    layers = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with saved.hooks():
        out = layers(x)
    found = saved.candidates()
    # Not x (the caller holds it), the weights or their transposed views, nor out: the GELU's
    # input and output, 3 x 16 floats each.
    assert [r.nbytes for r in found] == [3 * 16 * 4, 3 * 16 * 4]
    assert out.requires_grad


def test_the_fraction_takes_the_fewest_earliest_tensors_that_reach_it():
    assert chosen_prefix([4, 1, 1, 1, 1], 0.5) == 1
    assert chosen_prefix([1, 4, 1, 1, 1], 0.5) == 2
    assert chosen_prefix([1, 1, 1, 1], 0.0) == 0
    assert chosen_prefix([1, 1, 1, 1], 1.0) == 4
    assert chosen_prefix([], 0.7) == 0


def test_the_host_backend_round_trip_keeps_bytes_shape_and_strides():
    path = CopyPath(CPU, force=True)
    t = torch.randn(5, 7).t()  # dense, not contiguous
    assert path.fits(t) and not path.fits(torch.randn(10)[2:])
    host, out = path.to_host(t)
    back, into = path.to_device(host, (t.shape, t.stride(), t.dtype), out)
    path.wait(back, into, None)
    assert back.stride() == t.stride() and torch.equal(back, t)
    out.synchronize()
    assert pending_copies() == 0


def test_a_device_copy_is_never_held_twice_nor_kept_past_its_read():
    """A late copy out is waited for before the copy back allocates, and neither stays in the registry."""
    import gc
    import weakref

    from _memory_utils import install_counter_or_skip

    from fastpipe.memory import _cpu_counter
    from fastpipe.runtime.offload import _Saved

    install_counter_or_skip()
    path = CopyPath(CPU, force=True)
    t = torch.randn(256, 1024)  # 1 MiB; the host copies are _C's pool, which the counter does not see
    expected, nbytes = t.clone(), t.numel() * t.element_size()
    gc.collect()
    base = _cpu_counter.allocated()
    record = _Saved(t, path)
    del t
    device_table.copy_stream(CPU, "out").delay(0.05)  # the copy out lands after the fetch starts
    record.offload()
    record.fetch()
    assert _cpu_counter.allocated() - base == 0  # the device copy went before the one brought back came
    back = record.get()
    assert torch.equal(back, expected)
    brought = weakref.ref(back)
    del back, record
    assert brought() is None  # the registry dropped it once the read had waited for it
    assert _cpu_counter.allocated() - base == -nbytes and pending_copies() == 0


@pytest.mark.parametrize(
    "spec, match",
    [
        (1.5, "a fraction in \\[0, 1\\]"),
        (-0.1, "a fraction in \\[0, 1\\]"),
        ("half", "accepted forms"),
        (True, "accepted forms"),
        (object(), "accepted forms"),
        ([0.5], "one per stage"),
        ([0.5, "x"], "accepted forms"),
        (lambda i, layer: "yes", "must return a bool"),
    ],
)
def test_bad_offload_settings_are_refused_naming_the_accepted_forms(spec, match):
    with pytest.raises(ValueError, match=match):
        Pipe(model(), balance=[4, 4], chunks=2, offload=spec)
    assert "fn(index, layer) -> bool" in FORMS


def test_the_forms_resolve_to_per_stage_policies():
    layers = [[nn.Linear(2, 2), nn.GELU()], [nn.Linear(2, 2), nn.GELU()]]
    assert resolve_offload(0.25, layers) == [OffloadPolicy(0.25), OffloadPolicy(0.25)]
    assert resolve_offload(0, layers) == [None, None]
    assert resolve_offload(None, layers) == [None, None]
    assert resolve_offload([None, 1], layers) == [None, OffloadPolicy(1.0)]
    gelus = resolve_offload(lambda i, layer: isinstance(layer, nn.GELU), layers)
    assert gelus == [OffloadPolicy(1.0, frozenset({1})), OffloadPolicy(1.0, frozenset({1}))]
    assert resolve_offload(lambda i, layer: i == 2, layers) == [None, OffloadPolicy(1.0, frozenset({0}))]


def test_offload_on_cpu_stages_is_a_warned_no_op(monkeypatch):
    copies = Copies(monkeypatch)
    with pytest.warns(UserWarning, match="does nothing on CPU stages \\(0, 1\\)"):
        pipe = Pipe(model(), balance=[4, 4], chunks=4, offload=0.5, trace=True)
    assert all(stage.offload is None for stage in pipe._stages)
    pipe.train_step(torch.randn(16, 8), torch.randn(16, 8), nn.MSELoss())
    assert copies.count == 0 and not any(e.kind == "P" for e in pipe.last_timeline.events)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipe(model(), balance=[4, 4], chunks=4, offload="auto")  # nothing to choose without a limit: no warning


def test_a_host_without_page_locked_memory_is_refused_clearly(monkeypatch):
    def no_pinned(pinned):
        raise RuntimeError("pinned memory needs the CUDA backend: no driver")

    monkeypatch.setattr(
        device_table, "capabilities", lambda d: device_table.Capabilities(streams=False, c_copies=True, pinned=True)
    )
    monkeypatch.setattr(device_table, "host_pool", no_pinned)
    with pytest.raises(HostMemoryError, match="page-locked \\(pinned\\) host memory.*no driver"):
        check_host_memory(torch.device("meta"))
    stage = type(
        "Stage", (), {"device": torch.device("meta"), "module": nn.Sequential(nn.Linear(2, 2)), "offload": None}
    )
    with pytest.raises(HostMemoryError):
        PipeOffload(0.5, [stage()])
    assert host_copies.copy_path(CPU) is None


def test_a_graph_dropped_without_its_backward_frees_what_offload_saved(monkeypatch):
    import gc
    import weakref

    made = []
    original = SavedSet.pack

    def pack(saved, t):
        packed = original(saved, t)
        if not isinstance(packed, torch.Tensor):
            made.append(weakref.ref(packed))
        return packed

    monkeypatch.setattr(SavedSet, "pack", pack)
    pipe = forced(Pipe(model(), balance=[4, 4], chunks=4, checkpoint="never"), 0.5)
    out = pipe(torch.randn(16, 8))
    assert out.requires_grad and made
    del out  # no backward: the graphs go, and with them every record the forwards saved
    gc.collect()
    assert not [ref for ref in made if ref() is not None]
