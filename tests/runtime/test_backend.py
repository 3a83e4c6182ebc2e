"""The backend that serves a stage's device, also for groups made without one backend."""

import pytest
import torch.distributed as dist

from fastpipe.distributed.backend import backend_for, parse_backend_config


def test_parse_backend_config():
    assert parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_config("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert parse_backend_config("cuda:nccl") == {"cuda": "nccl"}


@pytest.mark.parametrize("backend", [None, "gloo", "cpu:gloo,cuda:gloo"])
def test_group_without_a_backend_is_gloo_for_cpu(tmp_path, backend):
    # init_process_group() without backend= (the README's torchrun form) names "undefined".
    kwargs = {} if backend is None else {"backend": backend}
    dist.init_process_group(init_method=f"file://{tmp_path}/store", rank=0, world_size=1, **kwargs)
    try:
        group = dist.group.WORLD
        if backend is None:
            assert dist.get_backend(group) == "undefined"
        assert backend_for(group, "cpu") == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_group_without_a_backend_for_the_stage_device_is_refused_with_advice(tmp_path):
    # torch 2.13 on a CUDA host: init_process_group() without backend= configures cuda:nccl only.
    from fastpipe.distributed.backend import require_backend

    dist.init_process_group(backend="cuda:gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert backend_for(group, "cpu") == "undefined"
        assert require_backend(group, "cuda") == "gloo"
        with pytest.raises(ValueError, match='backend="cpu:gloo,cuda:nccl"'):
            require_backend(group, "cpu")
    finally:
        dist.destroy_process_group()


def test_abort_leaves_a_gloo_group_working(tmp_path):
    import torch

    from fastpipe.distributed.backend import abort_nccl

    dist.init_process_group(backend="gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert abort_nccl(None) is False
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_abort_aborts_the_cuda_backend_of_an_nccl_group(monkeypatch):
    import torch

    from fastpipe.distributed import backend as backend_mod

    calls = []

    class FakeBackend:
        def abort(self):
            calls.append("abort")

    class FakeGroup:
        def _get_backend(self, device):
            calls.append(str(device))
            return FakeBackend()

    monkeypatch.setattr(backend_mod, "backend_for", lambda group, device: {"cuda": "nccl"}[torch.device(device).type])
    assert backend_mod.abort_nccl(FakeGroup()) is True
    assert calls == ["cuda", "abort"]


def test_abort_falls_back_to_torch_s_group_abort(monkeypatch):
    import torch

    from fastpipe.distributed import backend as backend_mod

    aborted = []

    class Group:
        def _get_backend(self, device):
            return object()  # a Backend binding without abort()

    group = Group()
    monkeypatch.setattr(backend_mod, "backend_for", lambda group, device: {"cuda": "nccl"}[torch.device(device).type])
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", aborted.append)
    assert backend_mod.abort_nccl(group) is True
    assert aborted == [group]


def test_abort_without_a_backend_abort_leaves_world_and_side_groups_usable(tmp_path, monkeypatch):
    # torch's _abort_process_group(WORLD) would abort and unregister every group: the side
    # groups would stop working and the caller's destroy_process_group() would raise.
    import torch
    import torch._C._distributed_c10d as c10d

    from fastpipe.distributed import backend as backend_mod

    dist.init_process_group(backend="cpu:gloo,cuda:gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        side = dist.new_group([0], backend="gloo")
        monkeypatch.delattr(c10d.Backend, "abort")  # a torch whose Backend binding has no abort
        monkeypatch.setattr(backend_mod, "backend_for", lambda group, device: "nccl")  # WORLD's CUDA side as NCCL
        assert backend_mod.abort_nccl(None) is False
        assert backend_mod.abort_nccl(dist.group.WORLD) is False
        for group in (dist.group.WORLD, side):
            t = torch.ones(2)
            dist.all_reduce(t, group=group)
            assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()  # raises if the groups were unregistered
