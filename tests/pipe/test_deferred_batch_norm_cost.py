"""DeferredBatchNorm's bookkeeping: exact statistics without fp64 activation copies or host syncs."""

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fastpipe import DeferredBatchNorm


class Watch(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((getattr(func, "__name__", str(func)), out))
        return out


@pytest.mark.parametrize("momentum", [0.1, None])
def test_far_from_zero_inputs_give_full_batch_statistics(momentum):
    # A large mean over a unit variance: E[x^2] - E[x]^2 in fp32 would lose the variance
    # (an ulp of 1e6 is 0.06). The reference is BatchNorm over the very same numbers in
    # fp64; fp32 statistics of values near 3e3 are good to a few ulps of 3e3 (2.4e-4).
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=momentum).double()
    dbn = DeferredBatchNorm.convert(nn.BatchNorm1d(3, momentum=momentum))
    for step in range(3):
        x = torch.randn(64, 3) + 1e3 * (step + 1)
        bn(x.double())
        for mb in x.split([7, 20, 37]):  # uneven micro-batches
            dbn(mb)
        dbn.commit()
    torch.testing.assert_close(dbn.running_mean, bn.running_mean.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(dbn.running_var, bn.running_var.float(), rtol=1e-3, atol=1e-5)
    assert int(dbn.num_batches_tracked) == int(bn.num_batches_tracked) == 3


def test_no_host_sync_and_no_activation_sized_fp64_tensor():
    dbn = DeferredBatchNorm.convert(nn.BatchNorm2d(4, momentum=None))
    x = torch.randn(8, 4, 5, 5)
    with Watch() as watch:
        dbn(x)
        dbn(x)
        dbn.commit()
    names = [n for n, _ in watch.calls]
    assert not {"item", "__float__", "__int__", "tolist"} & set(names), names
    big64 = [n for n, out in watch.calls
             if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() > 4]
    assert big64 == []
