"""start_transfer's copies stay bit-exact when the consumer's stream lags and memory is reused.

The copy's destination is allocated on the starting thread's current stream (here the default
one) and read on another (a busy side stream). ``Transfer.wait`` must then tell the caching
allocator about the side stream (``record_stream``): otherwise, once the last Python reference
is gone, the default stream gets the same block back for the next allocation of that size and
overwrites it while the side stream's queued kernels have not read it yet.

    default stream:  copy ready ── drop ── alloc same size, fill(-1) ───────────▶
    side stream:     _sleep(busy) ─────────────────────── read result (clone) ──▶
"""

import pytest
import torch

from fastpipe.runtime.transfer import start_transfer, synchronize_pending

pytestmark = [pytest.mark.gpu, pytest.mark.time_limit(30)]

SHAPES = [(1024,), (256, 1024), (4096, 1024)]  # 4 KiB, 1 MiB, 16 MiB: several allocator pools


@pytest.mark.parametrize("source", ["cpu", "cuda:0"])
def test_transfer_read_on_a_busy_side_stream_is_bit_exact(source):
    side = torch.cuda.Stream()
    for round_ in range(4):
        for shape in SHAPES:
            expected = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + round_
            src = expected.to(source)
            # force: a cuda:0 -> cuda:0 copy still goes through the copy stream.
            transfer = start_transfer(src, "cuda:0", force=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)  # keeps the side stream busy for some ms
                received = transfer.wait()
                out = received.clone()
            del received, transfer
            synchronize_pending()  # the copy is done: its deferred-release entry lets go of the block
            # The default stream is idle: these run at once, long before the side stream's clone.
            reused = [torch.empty(shape, device="cuda:0").fill_(-1.0) for _ in range(4)]
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), expected), f"{source} {shape} round {round_}: the block was reused"
            del reused
