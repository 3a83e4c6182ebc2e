"""Multi-process pipelines (gloo, spawned ranks): the same numbers as one process."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import close_reordered
from torch import nn

# The helper scripts sit in tests/, one folder up.
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
HIDDEN = 16
# Reductions from input to loss through make_model's 8 blocks, plus the rows a weight gradient
# sums over: a pipeline's micro-batches round differently from the plain model's full batch.
K = 8 * HIDDEN + HIDDEN + 16


def transport_of(pipe: object) -> str:
    from fastpipe.distributed.p2p_ordered import OrderedTransport

    return "ordered" if isinstance(pipe.runtime.transport, OrderedTransport) else "tags"  # type: ignore[attr-defined]


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Dropout(dropout)) for _ in range(8)])


def make_batch(seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, HIDDEN, generator=g), torch.randn(*shape, HIDDEN, generator=g)


def _schedules(rank: int, world: int, transport: str) -> list[str]:
    from fastpipe import Pipe
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    for name, v in SCHEDULES:
        balance = [8 // (world * v)] * (world * v)
        pipe = DistributedPipe(make_model(), balance, chunks=4, schedule=name, timeout=20)
        if transport_of(pipe) != transport:
            problems.append(f"ran over the {transport_of(pipe)} transport, not {transport}")
        local = Pipe(make_model(), balance, chunks=4)
        plain = make_model()
        for step in range(2):  # the second step reuses the receive buffers
            x, y = make_batch(step, 8)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
            expected = local.train_step(x, y, nn.MSELoss(), schedule=name, virtual_stages=v)
            plain_loss = nn.MSELoss()(plain(x), y)
            plain_loss.backward()
            if not torch.equal(loss, expected):
                problems.append(f"{name} step {step}: loss {loss.item()} != local {expected.item()}")
            if not close_reordered(loss, plain_loss, k=K):
                problems.append(f"{name} step {step}: loss {loss.item()} != plain {plain_loss.item()}")
        ref_local = dict(local.named_parameters())
        ref_plain = dict(plain.named_parameters())
        names = [n for n, _ in pipe.named_parameters()]
        if len(names) != 2 * sum(balance[s] for s in range(rank, len(balance), world)):
            problems.append(f"{name}: rank {rank} holds parameters {names}")
        for n, p in pipe.named_parameters():
            if p.grad is None or not torch.equal(p.grad, ref_local[n].grad):
                problems.append(f"{name}: grad of {n} differs from the local Pipe")
            elif not close_reordered(p.grad, ref_plain[n].grad, k=K):
                problems.append(f"{name}: grad of {n} differs from the plain Sequential")
        pipe.close()
    for name, v in [("1f1b", 1), ("interleaved", 2)]:  # dropout: the same masks as one process
        balance = [8 // (world * v)] * (world * v)
        pipe = DistributedPipe(make_model(dropout=0.3), balance, chunks=4, schedule=name, timeout=20)
        local = Pipe(make_model(dropout=0.3), balance, chunks=4)
        x, y = make_batch(0, 8)
        torch.manual_seed(42)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        torch.manual_seed(42)
        expected = local.train_step(x, y, nn.MSELoss(), schedule=name, virtual_stages=v)
        if not torch.equal(loss, expected):
            problems.append(f"{name} with dropout: loss {loss.item()} != local {expected.item()}")
        ref_local = dict(local.named_parameters())
        for n, p in pipe.named_parameters():
            if not torch.equal(p.grad, ref_local[n].grad):
                problems.append(f"{name} with dropout: grad of {n} differs from the local Pipe")
        pipe.close()
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_losses_and_grads_equal_one_process_for_every_schedule(world: int, transport: str) -> None:
    for rank, problems in enumerate(check_ok(run_ranks(_schedules, world, transport, timeout=90))):
        assert problems == [], f"rank {rank}: {problems}"


def _hooked(rank: int, world: int, transport: str) -> list[str]:
    from fastpipe.distributed_pipe import DistributedPipe

    def hook(model: nn.Sequential, calls: list[str]) -> None:
        for i, block in enumerate(model):
            block[0].weight.register_hook(lambda g, i=i: calls.append(f"{i}") or g * 2)

    plain, plain_calls = make_model(), []
    hook(plain, plain_calls)
    model, calls = make_model(), []
    hook(model, calls)
    pipe = DistributedPipe(model, [4, 4], chunks=4, schedule="1f1b", timeout=20)
    x, y = make_batch(0, 8)
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    nn.MSELoss()(plain(x), y).backward()
    problems = [] if sorted(calls) == [str(i) for i in range(4 * rank, 4 * rank + 4)] else [f"hook calls {calls}"]
    ref = dict(plain.named_parameters())
    for n, p in pipe.named_parameters():
        if p.grad is None or not close_reordered(p.grad, ref[n].grad, k=K):
            problems.append(f"grad of {n} differs from the plain Sequential with the same hooks")
    pipe.close()
    return problems


def test_parameter_hooks_run_once_on_the_step_gradient(transport: str) -> None:
    for rank, problems in enumerate(check_ok(run_ranks(_hooked, 2, transport, timeout=60))):
        assert problems == [], f"rank {rank}: {problems}"


class ToTuple(nn.Module):
    """Makes the value crossing the stage boundary a tuple with non-tensor items."""

    def forward(self, x: torch.Tensor) -> tuple:
        # int64, bool and empty tensors cross the rank boundary too (an empty one has no payload)
        return (x, x.size(1), "tag", (x > 0).sum(-1), x.new_zeros(0, 3), x[..., :1] > 0)


class FromTuple(nn.Module):
    def forward(self, value: tuple) -> torch.Tensor:
        x, length, tag, count, empty, mask = value
        assert tag == "tag" and length == x.size(1)
        assert empty.shape == (0, 3) and mask.dtype == torch.bool and mask.shape == (*x.shape[:-1], 1)
        return x * 2 + count.unsqueeze(-1).to(x.dtype) * 0.01 + mask.to(x.dtype) * 0.001


def _dynamic(rank: int, world: int, transport: str) -> list[tuple[int, float, float]]:
    from fastpipe.distributed_pipe import DistributedPipe

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), ToTuple(), FromTuple(), nn.Linear(HIDDEN, HIDDEN))

    pipe = DistributedPipe(build(), [2, 2], chunks=2, schedule="1f1b", timeout=20)
    assert transport_of(pipe) == transport
    plain = build()
    out = []
    for step, length in enumerate([3, 5, 5, 2, 3]):  # new, changed, repeated, changed, changed
        x, y = make_batch(step, 4, length)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        out.append((length, loss.item(), expected.item()))
    ref = dict(plain.named_parameters())
    for n, p in pipe.named_parameters():
        assert close_reordered(p.grad, ref[n].grad, k=K), n
    return out


def test_dynamic_shapes_and_tuple_values_across_steps(transport: str) -> None:
    for steps in check_ok(run_ranks(_dynamic, 2, transport, timeout=60)):
        for length, got, expected in steps:
            assert got == pytest.approx(expected, rel=1e-5), f"sequence length {length}"


def _pp_dp(rank: int, world: int, transport: str) -> list[tuple[str, float, float, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh.get_local_rank("dp")
    x, y = make_batch(0, 16)
    mine = slice(dp_rank * 8, dp_rank * 8 + 8)  # each replica trains on its half of the global batch
    plain = make_model()
    expected = nn.MSELoss()(plain(x), y)
    expected.backward()
    ref = dict(plain.named_parameters())
    out = []
    for name, balance in [("1f1b", [4, 4]), ("zb-h1", [4, 4]), ("interleaved", [2, 2, 2, 2])]:
        pipe = DistributedPipe(
            make_model(), balance, chunks=2, schedule=name, mesh=mesh, timeout=20, bucket_bytes=2048
        )  # several buckets per stage
        assert transport_of(pipe) == transport
        loss = pipe.train_step(x[mine] if pipe.is_first else None, y[mine] if pipe.is_last else None, nn.MSELoss())
        worst = max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters())
        out.append((name, loss.item(), expected.item(), worst))
        pipe.close()
    return out


def test_pipeline_times_data_parallel_2x2_equals_global_batch(transport: str) -> None:
    for results in check_ok(run_ranks(_pp_dp, 4, transport, timeout=90)):
        for name, loss, expected, worst in results:
            assert loss == pytest.approx(expected, rel=1e-5), name
            assert worst < 1e-6, name


def _timed_steps(rank: int, world: int, steps: int) -> float:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(make_model(), [4, 4], chunks=4, schedule="1f1b", timeout=20)
    x, y = make_batch(0, 8)
    start = time.perf_counter()
    for _ in range(steps):
        pipe.train_step(x, y, nn.MSELoss())
    return time.perf_counter() - start


def test_steps_are_not_slowed_by_polling() -> None:
    # A tiny model: a step is nearly all communication; 20 steps must not take seconds.
    (elapsed, _) = check_ok(run_ranks(_timed_steps, 2, 20, timeout=60))
    assert elapsed < 5.0, f"20 tiny steps took {elapsed:.2f} s"


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class Slow(nn.Module):
    """Identity that takes 30 ms: the next rank must be seen waiting for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return x


def _model_with_slow_stage_0() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Slow(), nn.Linear(4, 4), nn.Linear(4, 4))


def _through_pipe(rank: int, world: int) -> tuple[str, float, list[tuple[str, float]], str]:
    import torch.distributed as dist

    from fastpipe import DistributedPipe

    pipe = DistributedPipe(
        _model_with_slow_stage_0(), balance=[2, 2], chunks=2, schedule="1f1b", process_group=dist.group.WORLD
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None, nn.MSELoss(), trace=True)
    events = pipe.last_timeline.events
    compute = [e.action for e in events if "RECV" not in e.action]
    assert sorted(compute) == sorted(f"{rank}{k}{m}" for k in ("F", "BW") for m in range(2))
    assert all(e.worker == rank for e in events)
    waits = [(e.action, e.duration) for e in events if "RECV" in e.action]
    return type(pipe).__name__, float(loss), waits, transport_of(pipe)


def test_distributed_pipe_traces_its_waits(transport: str) -> None:
    outcomes = run_ranks(_through_pipe, 2)
    model = _model_with_slow_stage_0()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    expected = float(nn.functional.mse_loss(model(x), y).detach())
    for outcome in outcomes:
        assert "ok" in outcome, outcome
        name, loss, _, used = outcome["ok"]
        assert name == "DistributedPipe" and used == transport
        assert abs(loss - expected) < 1e-6
    # Rank 1 waits ~30 ms for an activation of the slow stage 0; the timeline says so.
    waits = outcomes[1]["ok"][2]
    assert all(a.startswith("1RECV_F") for a, _ in waits), waits
    assert max((d for _, d in waits), default=0.0) > 0.02, waits
    assert all(a.startswith("0RECV_B") for a, _ in outcomes[0]["ok"][2])


class _Coalesced:
    """One work for a whole batch that completes in the background, as NCCL's coalesced work does."""

    def __init__(self, works: list) -> None:
        import threading

        self.works = works
        self.done = threading.Event()
        threading.Thread(target=self._finish, daemon=True).start()

    def _finish(self) -> None:
        for w in self.works:
            w.wait()
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: object = None) -> bool:
        return self.done.wait(30.0)


def _nccl_shaped(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from fastpipe import Pipe
    from fastpipe.distributed_pipe import DistributedPipe

    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_Coalesced(real(ops))]  # type: ignore[assignment]
    problems = []
    for name, v in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]:
        balance = [8 // (world * v)] * (world * v)
        pipe = DistributedPipe(make_model(), balance, chunks=4, schedule=name, timeout=20)
        transport = pipe.runtime.transport
        transport.polls = transport._payload_sends.poll = True  # NCCL's way of waiting
        local = Pipe(make_model(), balance, chunks=4)
        for step in range(2):
            x, y = make_batch(step, 8)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
            expected = local.train_step(x, y, nn.MSELoss(), schedule=name, virtual_stages=v)
            if not torch.equal(loss, expected):
                problems.append(f"{name} step {step}: {loss.item()} != {expected.item()}")
        ref = dict(local.named_parameters())
        problems += [f"{name}: grad of {n}" for n, p in pipe.named_parameters() if not torch.equal(p.grad, ref[n].grad)]
        pipe.close()
    return problems


def test_ordered_transport_with_nccl_shaped_works(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL returns one coalesced work per batch and its wait() does not block the host, so
    # the ordered transport polls: that control flow, on gloo.
    monkeypatch.setenv("FASTPIPE_P2P", "ordered")
    for rank, problems in enumerate(check_ok(run_ranks(_nccl_shaped, 2, timeout=90))):
        assert problems == [], f"rank {rank}: {problems}"


def test_torchrun_runs_the_readme_example(tmp_path, transport: str) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "losses.json"
    script = os.path.join(TESTS_DIR, "_torchrun_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert result["transport"] == ("OrderedTransport" if transport == "ordered" else "P2PTransport")
    assert result["losses"] == pytest.approx(result["expected"], rel=1e-5)
    assert result["losses"][2] < result["losses"][0]  # it trains


def test_torchrun_with_two_nodes_on_one_host(tmp_path) -> None:
    # --nnodes 2: two launcher agents rendezvous at a master address, as on two hosts.
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "losses.json"
    script = os.path.join(TESTS_DIR, "_torchrun_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("FASTPIPE_P2P", None)
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                script,
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        outputs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert all(a.returncode == 0 for a in agents), [err[-2000:] for _, err in outputs]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["losses"] == pytest.approx(result["expected"], rel=1e-5)
