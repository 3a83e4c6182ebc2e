import platform
import subprocess
import sys

import pytest

from fastpipe.runtime.host_alloc import tune_host_allocator

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc, reason="glibc only")
def test_tuning_applies_once_on_glibc():
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True  # idempotent


# In a fresh process (the settings are process-wide): whether a pipe's first step applied them.
_PIPES = """
import os, torch
from torch import nn
from fastpipe import Pipe
from fastpipe.runtime import host_alloc

def step(pipe):
    pipe.train_step(torch.randn(4, 3), torch.randn(4, 3), nn.MSELoss())
    return host_alloc._state

def pipe(**kw):
    return Pipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), balance=[1, 1], chunks=2, **kw)

os.environ["FASTPIPE_TUNE_MALLOC"] = "0"
off_by_env = pipe()
os.environ["FASTPIPE_TUNE_MALLOC"] = "1"  # read when the pipe was built, not at its step
print(step(off_by_env), step(pipe(tune_malloc=False)), step(pipe()))
"""


def test_a_pipe_tunes_the_allocator_only_when_built_to():
    env = {"PATH": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PIPES], env=env, capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["None", "None", str(glibc)]
