"""One writer per run folder: an advisory lock held for a whole training session.

``lapse train`` and ``lapse resume`` take an exclusive ``flock`` on ``RUN/.lock`` before
they write anything, and write their pid into it. A second command on the same folder
fails at once with :class:`RunInUse` naming that pid. The kernel drops the lock when its
process ends, however it ends (SIGKILL too), so a lock left by a dead process never
blocks; the pid left in the file is only read while someone holds the lock.

``fcntl.flock`` rather than the ``filelock`` package: the holder's pid lives in the locked
file itself, which a contender may read but must not truncate. Under ``torchrun`` rank 0
takes the lock for all ranks (:func:`hold_run_dir` in :mod:`.trainer`).
"""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"


class RunInUse(RuntimeError):
    """Another process holds the run folder's lock."""


@contextmanager
def run_lock(run_dir: str | Path):
    """Hold the lock of ``run_dir`` (created if needed) inside the ``with`` block; raises
    :class:`RunInUse` at once when another process holds it."""
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise RunInUse(
                f"{run_dir} is in use by another lapse process (pid {holder}); wait for it to end "
                "or choose another run folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
