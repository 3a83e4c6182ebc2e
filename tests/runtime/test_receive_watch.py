"""NCCL receives are waited for on the GPU, with a background watch as their time bound.

The NCCL path cannot run on CPU; its watch (a ``SendReaper`` that polls) is checked here
with stand-in works: a receive that never completes fails the step within the bound,
without the host ever waiting on the receive itself.
"""

import threading
import time

import pytest

from fastpipe.distributed.watchdog import SendReaper, Watchdog
from fastpipe.errors import PipelineError


class FakeWork:
    def __init__(self, done_after=None):
        self.born = time.monotonic()
        self.done_after = done_after
        self.waited = threading.Event()

    def is_completed(self):
        return self.done_after is not None and time.monotonic() - self.born >= self.done_after

    def wait(self, timeout=None):
        self.waited.set()
        return True


def test_late_receive_fails_at_the_next_check():
    watchdog = Watchdog(None, "abort", timeout=0.2, rank=3)
    watch = SendReaper(0.2, poll=True, what="a payload receive on")
    watch.add(FakeWork(done_after=None), None)  # never completes
    watch.check(watchdog)  # not yet late: no error, no wait
    time.sleep(0.5)
    with pytest.raises(PipelineError, match="a payload receive on rank 3 did not complete"):
        watch.check(watchdog)
    watch.close()


def test_completed_receives_drain_quickly():
    watchdog = Watchdog(None, "abort", timeout=5, rank=0)
    watch = SendReaper(5, poll=True, what="a payload receive on")
    works = [FakeWork(done_after=0.01 * i) for i in range(5)]
    for w in works:
        watch.add(w, None)
    started = time.monotonic()
    watch.drain(watchdog)
    assert time.monotonic() - started < 2
    assert all(w.waited.is_set() for w in works)
    watch.close()


class CountingWork(FakeWork):
    def __init__(self, done_after):
        super().__init__(done_after)
        self.polls = 0

    def is_completed(self):
        self.polls += 1
        return super().is_completed()


def test_the_watch_backs_off_instead_of_spinning():
    # Every poll takes the GIL from the thread that launches the kernels: a 0.3 s wait polled
    # every 0.1 ms is thousands of polls; backing off to a 2 ms pause makes it about 150.
    watchdog = Watchdog(None, "abort", timeout=5, rank=0)
    watch = SendReaper(5, poll=True, what="a payload receive on")
    work = CountingWork(done_after=0.3)
    watch.add(work, None)
    watch.drain(watchdog)
    assert work.waited.is_set()
    assert work.polls < 400
    watch.close()


def test_a_late_receive_fails_the_step_and_aborts_while_the_step_thread_is_blocked():
    # The step's thread may sit in a CUDA synchronize behind the hung receive and never call
    # check() or drain(): the watch itself must fail the step and abort the communicators.
    aborted = threading.Event()
    told = []
    watchdog = Watchdog(None, "abort", timeout=0.2, rank=3)
    watchdog.on_fail = told.append
    watchdog.aborts.append(aborted.set)
    watch = SendReaper(0.2, poll=True, what="a payload receive on")
    watch.check(watchdog)  # as the transport does before each receive it hands over
    watch.add(FakeWork(done_after=None), None)  # never completes
    assert aborted.wait(3.0), "the watch never aborted the communicators"
    assert isinstance(watchdog.failure, PipelineError)
    assert "a payload receive on rank 3 did not complete" in str(watchdog.failure)
    assert told == ["a payload receive on rank 3 did not complete (timed out after 0.2 s)"]
    with pytest.raises(PipelineError, match="did not complete"):  # the step's thread, once it runs again
        watchdog.check()
    watch.close()
