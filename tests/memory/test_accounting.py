"""PeakMeter measures a block's exact peak bytes, on every thread, with the static bytes split out exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from _memory_utils import on_thread
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.accounting import PeakMemory, PeakMeter, StaticBytes, measure_peak, static_bytes


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 384), nn.GELU(), nn.Linear(384, 80))


def _clear_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_a_forward_on_a_worker_thread_peaks_at_its_saved_storages_plus_its_output() -> None:
    model, x = _mlp(), torch.randn(40, 96)
    model(x)  # first-call work (kernel choice, lazy state) stays out of the measurement
    old = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
    saved: dict[int, int] = {}
    out: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = _nbytes(t)
        return t

    def forward() -> None:
        # Saved-tensor hooks are thread-local: set them on the thread that runs the forward.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out.append(model(x))

    with PeakMeter("cpu") as meter:
        on_thread(forward)
    new_saved = sum(n for ptr, n in saved.items() if ptr not in old)
    assert new_saved == 2 * 40 * 384 * 4  # Linear's output (kept by GELU) and GELU's (kept by the second Linear)
    assert meter.result.peak == new_saved + _nbytes(out[0])
    assert meter.result.end == meter.result.peak


def _profiled_peak(fn: Callable[[], object]) -> int:
    """Peak bytes above the start that the profiler's memory events show for ``fn`` on this thread.

    An independent count: c10's default CPU allocator reports each allocation and free to the
    profiler of the thread that makes it (``experimental_event_tree`` is a private API, as used
    by torch's own memory profiler).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    total = highest = 0
    for _, size in sorted(events):
        total += size
        highest = max(highest, total)
    assert len(events) > 10, events
    return highest


def test_a_step_on_a_worker_thread_peaks_where_the_profiler_sees_it_on_the_calling_thread() -> None:
    model, x = _mlp(), torch.randn(40, 96)

    def step() -> None:
        model(x).square().mean().backward()

    step()  # first-call work stays out of both counts
    _clear_grads(model)
    expected = _profiled_peak(step)
    _clear_grads(model)
    with PeakMeter("cpu", modules=model) as meter:
        on_thread(step)
    result = meter.result
    # The backward holds every saved activation plus the first layer's input gradient at once.
    assert expected > 2 * 40 * 384 * 4
    assert result.peak == expected
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert result.static == StaticBytes(parameters=grads, gradients=grads, optimizer_state=0)
    assert result.end == grads and result.static_created == grads
    assert result.transient == expected - grads


def test_a_two_stage_pipe_train_step_is_counted_on_its_worker_threads() -> None:
    torch.manual_seed(0)
    width, hidden, batch, chunks = 32, 1024, 64, 4
    model = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
    pipe = Pipe(model, balance=[2, 1], chunks=chunks, checkpoint="never", schedule="gpipe")
    ran_on: set[int] = set()
    for layer in model:
        layer.register_forward_hook(lambda *_: ran_on.add(threading.get_ident()))
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    pipe.train_step(x, y, nn.MSELoss())
    _clear_grads(pipe)
    ran_on.clear()
    with PeakMeter("cpu", modules=pipe) as meter:
        pipe.train_step(x, y, nn.MSELoss())
    assert ran_on and threading.get_ident() not in ran_on, "the stages must run on worker threads for this test"
    result = meter.result
    grads = sum(p.numel() * 4 for p in pipe.parameters())
    assert result.static.gradients == grads and result.end >= grads
    # GPipe holds every micro-batch's two hidden activations (Linear's and GELU's outputs) at the
    # end of the forwards, all allocated on the stage workers.
    activations = 2 * batch * hidden * 4
    assert result.peak >= activations
    assert result.transient >= activations - grads


def test_static_bytes_count_a_tied_weight_once_and_skip_other_devices() -> None:
    embed = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embed.weight  # tied: one storage
    model = nn.Sequential(embed, head)
    elsewhere = nn.Linear(4, 4, device="meta")
    assert static_bytes("cpu", [model, elsewhere]) == StaticBytes(
        parameters=50 * 16 * 4, gradients=0, optimizer_state=0
    )


def test_static_bytes_count_a_storage_that_a_view_shares_once_at_its_full_size() -> None:
    flat = torch.zeros(100)
    layer = nn.Linear(3, 3, bias=False)
    layer.weight = nn.Parameter(flat[:9].view(3, 3))
    other = nn.Linear(3, 1, bias=False)
    other.weight = nn.Parameter(flat[9:12].view(1, 3))
    assert static_bytes("cpu", [layer, other]).parameters == 400  # the whole storage, once


def test_static_bytes_count_adam_state_exactly() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    # exp_avg and exp_avg_sq per element, and a float32 step counter per parameter
    assert static_bytes("cpu", optimizers=opt) == StaticBytes(
        parameters=4 * n, gradients=4 * n, optimizer_state=8 * n + 4 * tensors
    )


def test_a_first_step_splits_its_peak_into_created_static_and_transient() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(40, 96)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()

    result = measure_peak(step, "cpu", modules=model, optimizers=opt)
    n = sum(p.numel() for p in model.parameters())
    assert result.static_at_start == 4 * n
    assert result.static == StaticBytes(4 * n, 4 * n, 8 * n + 4 * 4)
    assert result.static_created == 12 * n + 16
    assert result.end == result.static_created  # all the step kept
    assert result.transient == result.peak - result.static_created > 0


def _hold_and_free(nbytes: int) -> None:
    held = torch.empty(nbytes, dtype=torch.uint8)
    del held


def test_an_inner_meter_leaves_the_outer_peak_reached_before_it_intact() -> None:
    with PeakMeter("cpu") as outer:
        _hold_and_free(150_000)
        with PeakMeter("cpu") as inner:
            _hold_and_free(20_000)
        kept = torch.empty(30_000, dtype=torch.uint8)
        with PeakMeter("cpu") as last:
            _hold_and_free(70_000)
        del kept
    assert (inner.result.peak, last.result.peak) == (20_000, 70_000)
    assert outer.result.peak == 150_000
    assert outer.result.end == 0


def test_an_outer_meter_keeps_the_peak_of_a_meter_nested_two_deep() -> None:
    with PeakMeter("cpu") as outer:
        with PeakMeter("cpu") as middle:
            with PeakMeter("cpu") as innermost:
                _hold_and_free(200_000)
            with PeakMeter("cpu") as sibling:  # resets the statistic again, inside `middle`
                _hold_and_free(10_000)
        kept = torch.empty(30_000, dtype=torch.uint8)
        del kept
    assert (innermost.result.peak, sibling.result.peak) == (200_000, 10_000)
    assert middle.result.peak == outer.result.peak == 200_000


def test_meters_must_close_in_reverse_order() -> None:
    outer, inner = PeakMeter("cpu"), PeakMeter("cpu")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)


def test_a_meter_measures_one_block_and_has_no_result_before_it_ends() -> None:
    meter = PeakMeter("cpu")
    with pytest.raises(RuntimeError, match="after its `with` block"):
        _ = meter.result
    with meter:
        pass
    with pytest.raises(RuntimeError, match="make a new one"), meter:
        pass


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), True])
def test_a_device_that_cannot_be_measured_is_refused_with_the_accepted_forms(device: object) -> None:
    with pytest.raises((ValueError, TypeError), match="'cpu'"):
        PeakMeter(device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_cuda_without_a_device_is_refused_with_what_to_measure_instead() -> None:
    with pytest.raises(ValueError, match="no CUDA device; measure 'cpu'"):
        PeakMeter("cuda:0")


def test_the_result_prints_mebibytes_with_units() -> None:
    result = PeakMemory(
        device=torch.device("cpu"),
        start=1 << 20,
        peak=3 << 20,
        end=1 << 19,
        static=StaticBytes(parameters=1 << 20, gradients=1 << 19, optimizer_state=0),
        static_at_start=1 << 20,
    )
    assert str(result) == (
        "cpu: peak 3.00 MiB above 1.00 MiB at start (transient 2.50 MiB, created static 0.50 MiB); "
        "at the end: parameters 1.00 MiB, gradients 0.50 MiB, optimizer state 0.00 MiB"
    )
    assert result.peak_total == 4 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_peak_is_the_caching_allocators() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    with PeakMeter(device) as meter:
        kept = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        dropped = torch.empty(3 << 20, dtype=torch.uint8, device=device)
        del dropped
    assert meter.result.peak == 4 << 20  # multiples of 512 bytes: no rounding
    assert meter.result.end == 1 << 20
    del kept
