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


@pytest.mark.parametrize("value, expected", [("0", "False"), ("1", str(glibc))])
def test_env_switch(value, expected):
    code = "from fastpipe.runtime.host_alloc import tune_host_allocator; print(tune_host_allocator())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"FASTPIPE_TUNE_MALLOC": value, "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert out.stdout.strip() == expected
