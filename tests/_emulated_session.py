"""Where the tests on the emulated accelerator run: in a pytest process of their own.

Registering the emulated device (tests/emulated_device.py) is process-wide and cannot be
undone: it becomes ``torch.accelerator``'s device, and so, for instance,
``init_process_group()`` without a backend then configures the accelerator's backend only,
and ``Tensor.pin_memory()`` asks the emulation for pinned memory. It must also come before
the process's first backward, as autograd's engine sizes its device threads then.

So a session that runs these tests next to others hands them to a child pytest, started
before its own tests, as one item that passes when they all pass (their report is its
output); a session of emulated-device tests only (``pytest tests/accelerator``) runs them
in place, registering the device at collection. On a CUDA host the fixture skips them
without registering anything: the real device threads are there (tests/pipe/test_gpu.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

__all__ = ["EMULATED_TEST_TIMEOUT", "arrange"]

#: Each test's time limit unless it sets its own: a deadlock in the device-thread backward
#: then fails with all stacks (and stops the session) instead of hanging it.
EMULATED_TEST_TIMEOUT = float(os.environ.get("FASTPIPE_EMULATED_TEST_TIMEOUT", "60"))
_CHILD = "FASTPIPE_EMULATED_DEVICE_CHILD"


class ChildFailed(Exception):
    """The child pytest reported failures (its output is the message)."""


class EmulatedDeviceTests(pytest.Item):
    """The session's emulated-device tests, run by a child pytest."""

    def __init__(self, *, nodeids: list[str], **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.nodeids = nodeids

    def runtest(self) -> None:
        config = self.config
        args = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *self.nodeids]
        if config.getoption("maxfail", 0) == 1:
            args.insert(4, "-x")
        proc = subprocess.run(
            args,
            cwd=str(config.rootpath),
            env=dict(os.environ, **{_CHILD: "1"}),
            capture_output=True,
            text=True,
            timeout=EMULATED_TEST_TIMEOUT * len(self.nodeids) + 120,
        )
        if proc.returncode != 0:
            raise ChildFailed(f"exit code {proc.returncode}\n{proc.stdout[-30000:]}\n{proc.stderr[-5000:]}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None) -> str:
        if isinstance(excinfo.value, ChildFailed):
            return f"the emulated-device tests failed in their child pytest: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return str(self.path), 0, f"{len(self.nodeids)} emulated-device tests, in a child pytest"


def arrange(session: pytest.Session, items: list[pytest.Item]) -> None:
    """Register the device for this session's emulated tests, or hand them to a child pytest."""
    emulated = [item for item in items if "emu" in getattr(item, "fixturenames", ())]
    if not emulated or torch.cuda.is_available():
        return
    if len(emulated) < len(items) and not os.environ.get(_CHILD):
        chosen = {id(item) for item in emulated}
        kept = [item for item in items if id(item) not in chosen]
        child = EmulatedDeviceTests.from_parent(
            session, name="emulated_device_tests", nodeids=[item.nodeid for item in emulated]
        )
        items[:] = [child, *kept]
        return
    import emulated_device

    with contextlib.suppress(emulated_device.RegisteredTooLate):  # the fixture raises it
        emulated_device.unavailable()
    for item in emulated:
        if item.get_closest_marker("time_limit") is None:
            item.add_marker(pytest.mark.time_limit(EMULATED_TEST_TIMEOUT))
