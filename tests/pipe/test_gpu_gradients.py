"""Pipe's gradients on CUDA equal plain gradient accumulation, with the caller on its own stream.

A stream race (a stage reading an activation or gradient before its copy or kernel has finished)
gives wrong numbers, not an error, so speed benches cannot see it: these tests compare every
gradient with the same model run micro-batch by micro-batch on the default stream. The caller's
stream is a new one, so every stage must carry it and order its copies against it.

bf16 runs under autocast: the pipe and the reference do the same bf16 GEMMs per micro-batch, so
they differ only where weight gradients are grouped differently (``wgrad_batch=2`` sums two
micro-batches in one GEMM, rounded once); that is a sum over the micro-batches (k = M) at bf16's
eps. A race is off by about the gradient's own size, far outside it. The sync audit records the
host syncs one bf16 zb-h1 step makes (file:line) into ``$FASTPIPE_SYNC_AUDIT``.
"""

import copy
import os
import warnings

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe

pytestmark = [pytest.mark.gpu, pytest.mark.time_limit(40)]

D, H, M, ROWS = 1024, 4096, 8, 8  # M micro-batches of ROWS rows
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-v"]
DEVICES = [["cuda:0", "cuda:0"], ["cpu", "cuda:0"]]
DTYPES = [torch.float32, torch.bfloat16]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.Tanh(), nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.Tanh()
    )


def stage_devices(schedule: str, devices: list[str]) -> tuple[list[int], list[str]]:
    """The balance, and each stage's device: zb-v holds 2 stages per worker in a V (0 1 | 1 0)."""
    if schedule == "zb-v":
        return [2, 2, 2, 2], [devices[0], devices[1], devices[1], devices[0]]
    return [4, 4], list(devices)


def autocast(dtype: torch.dtype):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def plain_accumulation(net, balance, devices, x, y, dtype):
    """The reference: the same stages on the same devices, one micro-batch after the other."""
    stages, start = [], 0
    for n, device in zip(balance, devices):
        stages.append(copy.deepcopy(net[start : start + n]).to(device))
        start += n
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        h = xs
        with autocast(dtype):
            for stage, device in zip(stages, devices):
                h = stage(h.to(device))
            loss = nn.functional.mse_loss(h, ys.to(h.device)) / M
        loss.backward()
    return [p.grad.detach().cpu() for s in stages for p in s.parameters()]


def compare(pipe, expected, dtype):
    got = [p.grad.detach().cpu() for p in pipe.parameters()]
    assert len(got) == len(expected)
    k = M if dtype == torch.bfloat16 else 2 * (D + H) + M * ROWS
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_close_reordered(a, b, k=k, dtype=dtype, msg=lambda m, i=i: f"parameter {i}: {m}")


def inputs():
    torch.manual_seed(1)
    return torch.randn(M * ROWS, D), torch.randn(M * ROWS, D)


def on_own_stream(fn):
    """Run ``fn`` with a new stream current, after the default stream's work; wait for it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn()
    stream.synchronize()
    torch.cuda.synchronize()
    return result


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("devices", DEVICES, ids=["gpu-gpu", "cpu-gpu"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_train_step_gradients_equal_plain_accumulation(schedule, devices, dtype):
    balance, placed = stage_devices(schedule, devices)
    x, y = inputs()
    expected = plain_accumulation(mlp(), balance, placed, x, y, dtype)
    virtual = 2 if schedule == "zb-v" else 1
    pipe = Pipe(mlp(), balance=balance, devices=devices, chunks=M, schedule=schedule, virtual_stages=virtual,
                wgrad_batch=2)  # fmt: skip

    def step():
        with autocast(dtype):
            return pipe.train_step(x.to(placed[0]), y, nn.MSELoss(), schedule=schedule)

    loss = on_own_stream(step)
    assert torch.isfinite(loss).all()
    compare(pipe, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("devices", DEVICES, ids=["gpu-gpu", "cpu-gpu"])
def test_forward_backward_gradients_equal_plain_accumulation(devices, dtype):
    balance, placed = stage_devices("gpipe", devices)
    x, y = inputs()
    expected = plain_accumulation(mlp(), balance, placed, x, y, dtype)
    pipe = Pipe(mlp(), balance=balance, devices=devices, chunks=M, wgrad_batch=2)

    def forward_backward():
        with autocast(dtype):
            out = pipe(x.to(placed[0]))
            loss = nn.functional.mse_loss(out, y.to(out.device))
        loss.backward()

    on_own_stream(forward_backward)
    compare(pipe, expected, dtype)


def test_sync_audit_of_a_bf16_zb_h1_step():
    """Lists every host sync of one bf16 zb-h1 step with a linear cross-entropy head, by file:line."""
    vocab = 8192
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.Linear(D, vocab))
    pipe = Pipe(net, balance=[2, 2], devices=["cuda:0", "cuda:0"], chunks=M, schedule="zb-h1")
    x, y = torch.randn(M * ROWS, D, device="cuda"), torch.randint(0, vocab, (M * ROWS,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pipe.train_step(x, y, nn.CrossEntropyLoss(), schedule="zb-h1")  # warm-up: first-use syncs are not the step's
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = pipe.train_step(x, y, nn.CrossEntropyLoss(), schedule="zb-h1")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:100]}" for w in caught
                    if "synchroniz" in str(w.message)})  # fmt: skip
    report = "\n".join(["one bf16 zb-h1 step, host syncs (file:line):", *syncs] if syncs else ["no host sync"])
    print(report)
    path = os.environ.get("FASTPIPE_SYNC_AUDIT")
    if path:
        with open(path, "w") as f:
            f.write(report + "\n")
    assert torch.isfinite(loss).all()
