"""The backend that serves a stage's device, also for groups made without one backend."""

import pytest
import torch.distributed as dist

from fastpipe.runtime.backend import backend_for, parse_backend_config


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
