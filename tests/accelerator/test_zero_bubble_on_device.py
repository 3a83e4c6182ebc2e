"""The zero-bubble schedules on the emulated accelerator: CUDA's autograd thread routing, V placement.

A V puts stages w and 2K-1-w on worker w, so a worker's two stages share its device when ``devices``
gives one per worker; the worker threads (and the autograd device thread, in ``Pipe.forward``'s
backward) then run both. Losses and gradients match the plain model on CPU.
"""

import pytest
import torch
from _eight_layers import K, model
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.schedule.placement import v_shape

CPU = torch.device("cpu")


@pytest.mark.parametrize("placement", ["emu,emu,emu,emu", "cpu,emu,emu,cpu", "emu,cpu,cpu,emu"])
@pytest.mark.parametrize("name", ["zb-h2", "zb-v", "dualpipev"])
def test_train_step_matches_plain(name, placement, emu):
    workers = [emu if p == "emu" else CPU for p in placement.split(",")]
    balance, virtual = {"zb-h2": ([2, 2, 2, 2], 1), "zb-v": ([1] * 8, 2), "dualpipev": ([2, 2, 2, 2], 2)}[name]
    workers = workers[: len(balance) // virtual]  # dualpipev: M = 4 needs 4 stages, 2 workers
    x, y = torch.randn(13, 8), torch.randn(13, 8)  # 13 in 4 chunks: 4, 4, 4, 1
    ref = model()
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    pipe = Pipe(model(), balance, devices=workers, chunks=4, schedule=name, virtual_stages=virtual)
    if virtual == 2:  # one device per worker, spread over the V
        assert pipe.devices == [workers[w] for w in v_shape(len(workers))]
    loss = pipe.train_step(x, y, nn.MSELoss())
    assert_close_reordered(loss.cpu(), loss_ref.detach(), k=K)
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert p.grad.device == p.device, n
        assert_close_reordered(p.grad.cpu(), q.grad, k=K, msg=n)
    # Pipe.forward's backward runs from the autograd device thread, whatever the train_step schedule.
    pipe.zero_grad(set_to_none=True)
    out = pipe(x)
    nn.MSELoss()(out, y.to(out.device)).backward()
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert_close_reordered(p.grad.cpu(), q.grad, k=K, msg=n)
    pipe.close()
