import os

# One intra-op thread per worker keeps the pipeline tests from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's models are small; on a CPU only Linears of 2**17 weight elements or more sum their
# weight gradients in the GEMM by default. Every Linear takes that path here, as wide layers would;
# tests/runtime/test_switches.py unsets it to test the default.
os.environ.setdefault("FASTPIPE_WGRAD_FUSE_MIN", "0")

import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Every gpu test runs under a time limit, so a hang (a deadlock in CUDA code) cannot eat
# a GPU run. At the limit, the stacks of all threads are dumped and the test fails with
# them (the main thread is interrupted with a signal); the session then stops, because
# threads stuck on a device can hang every later CUDA test. If the main thread cannot be
# interrupted (blocked inside C++, e.g. in autograd's engine), faulthandler dumps every
# thread a little later, from C, and ends the process. pytest-timeout is not needed.
GPU_TEST_TIMEOUT = float(os.environ.get("FASTPIPE_GPU_TEST_TIMEOUT", "120"))
HARD_EXIT_GRACE = float(os.environ.get("FASTPIPE_HARD_EXIT_GRACE", "15"))
HANG_DUMP = os.environ.get("FASTPIPE_HANG_DUMP") or os.path.join(
    tempfile.gettempdir(), f"fastpipe_hang_{os.getpid()}.txt"
)


class TestTimeout(Exception):
    """A test ran past its time limit."""


def _all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


_dump_file = None


def _hang_dump():
    global _dump_file
    if _dump_file is None:
        _dump_file = open(HANG_DUMP, "a")  # noqa: SIM115 - faulthandler writes to it while armed, all session
    return _dump_file


@contextlib.contextmanager
def time_limit(name: str, seconds: float):
    """Fail ``name`` after ``seconds`` with all threads' stacks; end the process if that cannot work."""
    dump = _hang_dump()

    def on_alarm(signum, frame):
        stacks = _all_stacks()
        dump.write(f"=== {name}: over its {seconds:.0f} s limit\n{stacks}\n")
        dump.flush()
        raise TestTimeout(f"{name}: over its {seconds:.0f} s limit; stacks of all threads:\n{stacks}")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + HARD_EXIT_GRACE, exit=True, file=dump)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("time_limit")
    limit = float(marker.args[0]) if marker else GPU_TEST_TIMEOUT if item.get_closest_marker("gpu") else 0.0
    if limit <= 0 or not hasattr(signal, "setitimer"):
        yield
        return
    with time_limit(item.nodeid, limit):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.excinfo is not None and call.excinfo.errisinstance(TestTimeout):
        item.session.shouldstop = f"{item.nodeid} timed out; later CUDA tests could hang behind its threads"
    return outcome


def pytest_configure(config):
    config.addinivalue_line("markers", "time_limit(seconds): this test's own time limit")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    # The emulated-device tests run in a child pytest when other tests share the session.
    if any("emu" in getattr(item, "fixturenames", ()) for item in items):
        import _emulated_session

        _emulated_session.arrange(session, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a folder named gpu matches it
            item.add_marker(skip)


@pytest.fixture
def emu():
    """The emulated accelerator ``emu:0`` (tests/emulated_device.py): CUDA's autograd thread routing on a CPU.

    Skips, saying why, on a CUDA host and where this torch cannot register a Python
    PrivateUse1 device. Fails a test that leaves emu tensors alive or torch's thread state
    changed.
    """
    import emulated_device

    reason = emulated_device.unavailable()
    if reason is not None:
        pytest.skip(reason)
    if emulated_device.stuck() is not None:
        pytest.fail(f"the emulated device's engine thread is stuck after {emulated_device.stuck()}")
    before = emulated_device.thread_state()
    yield emulated_device.device()
    after = emulated_device.thread_state()
    assert after == before, f"the test changed torch's thread state: {before} -> {after}"
    if emulated_device.stuck() is not None:
        return  # the test failed with the stacks; a leak check would wait behind the stuck thread
    left = emulated_device.live_tensors()
    assert not left, f"the test left {len(left)} emu tensors alive, e.g. {left[0].shape}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["tags", "ordered"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both P2P transports: tag-matched (gloo's default) and order-matched (what NCCL runs), on gloo."""
    if request.param == "ordered":
        monkeypatch.setenv("FASTPIPE_P2P", "ordered")  # inherited by the spawned ranks
    else:
        monkeypatch.delenv("FASTPIPE_P2P", raising=False)
    return str(request.param)


@pytest.fixture
def autograd_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that call torch.autograd.grad/backward during the test."""
    names: list[str] = []
    for fn in ("grad", "backward"):
        real = getattr(torch.autograd, fn)

        def spy(*args, _real=real, **kwargs):
            names.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, fn, spy)
    return names


def pytest_unconfigure(config):
    """Close the hang-dump file (opened at the first time-limited test) at the end of the session."""
    global _dump_file
    if _dump_file is not None:
        faulthandler.cancel_dump_traceback_later()
        _dump_file.close()
        _dump_file = None
