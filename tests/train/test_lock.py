"""One writer per run folder (lapse.train.lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lapse.train.lock import LOCK_FILE, RunInUse, run_lock

HOLD = """
import sys, time
from lapse.train.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(run_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    holder = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunInUse, match=f"in use by another lapse process \\(pid {holder.pid}\\)"):
            with run_lock(tmp_path):
                pass
        assert time.monotonic() - t0 < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holder_does_not_block(tmp_path):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / LOCK_FILE).read_text().strip() == str(holder.pid)  # left behind, stale
    with run_lock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
    with run_lock(tmp_path):  # released on leaving, taken again
        pass
