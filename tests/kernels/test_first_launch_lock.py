"""A kernel's first launch of a specialisation (its compile) runs in one thread at a time.

Pipeline stages launch kernels from their own threads, and Triton's compile-and-cache path
has not always been thread-safe; launches of a specialisation already seen take no lock.
"""

from __future__ import annotations

import threading
import time

import torch

from fastpipe.kernels._common import _launch_key, serialize_first_launches


class FakeKernel:
    def __init__(self) -> None:
        self.inside = 0
        self.most = 0
        self.guard = threading.Lock()

    def run(self, *args, **kwargs):
        with self.guard:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.05)
        with self.guard:
            self.inside -= 1


def _launch_from_threads(kernel: FakeKernel, args: tuple, threads: int = 4) -> None:
    workers = [threading.Thread(target=kernel.run, args=args) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def test_first_launches_are_serialised_and_later_ones_are_not():
    serialize_first_launches(FakeKernel)
    serialize_first_launches(FakeKernel)  # idempotent
    kernel = FakeKernel()
    x = torch.zeros(64)
    _launch_from_threads(kernel, (x, 64))
    assert kernel.most == 1, "a new specialisation compiled in two threads at once"
    kernel.most = 0
    _launch_from_threads(kernel, (x, 64))
    assert kernel.most > 1, "a launch of a seen specialisation still took the lock"


def test_the_key_follows_tritons_specialisation():
    x = torch.zeros(64)
    assert _launch_key((x, 32), {}) == _launch_key((torch.ones(64), 48), {})  # same dtype, both % 16 == 0
    assert _launch_key((x, 32), {}) != _launch_key((x, 33), {})
    assert _launch_key((x, 1), {}) != _launch_key((x, 17), {})
    assert _launch_key((x,), {}) != _launch_key((x.half(),), {})
    assert _launch_key((x[1:],), {}) != _launch_key((x,), {})  # 4-byte offset: not 16-byte aligned
    assert _launch_key((x,), {"BLOCK": 64}) != _launch_key((x,), {"BLOCK": 128})
