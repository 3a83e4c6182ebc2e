"""A test past its time limit fails with every thread's stack, and cannot hang the run.

gpu tests run under ``FASTPIPE_GPU_TEST_TIMEOUT`` (tests/conftest.py); the mechanism is
checked here on CPU through the ``time_limit`` marker, in a child pytest.
"""

import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

BODY = """
import signal, threading, pytest

@pytest.mark.time_limit(1)
def test_hangs_in_python():
    threading.Thread(target=threading.Event().wait, name="stuck-helper", daemon=True).start()
    threading.Event().wait()

def test_not_reached():
    pass

@pytest.mark.time_limit(1)
def test_cannot_be_interrupted():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # like a thread blocked inside C++
    threading.Event().wait()
"""


def run(tmp_path, selection):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_hang.py").write_text(BODY)
    dump = tmp_path / "dump.txt"
    env = dict(os.environ, FASTPIPE_HANG_DUMP=str(dump), FASTPIPE_HARD_EXIT_GRACE="2")
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:timeout",
            "-k",
            selection,
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, dump.read_text() if dump.exists() else "", time.monotonic() - started


def test_soft_limit_fails_with_all_stacks_and_stops_the_session(tmp_path):
    proc, dump, _ = run(tmp_path, "python or not_reached")
    assert proc.returncode in (1, 2), proc.stdout  # failed, and the session stopped
    assert "over its 1 s limit" in proc.stdout and "stuck-helper" in proc.stdout  # every thread's stack
    assert "1 failed" in proc.stdout and "passed" not in proc.stdout  # test_not_reached never ran
    assert "stuck-helper" in dump


def test_hard_limit_ends_the_process_with_a_dump(tmp_path):
    proc, dump, elapsed = run(tmp_path, "interrupted")
    assert proc.returncode != 0
    assert "Thread" in dump and "test_cannot_be_interrupted" in dump  # faulthandler's all-thread dump
    assert elapsed < 60
