"""A first Ctrl-C (or SIGTERM) that asks a long loop to stop at its next boundary, so that what
it finished is kept; a second Ctrl-C stops at once."""

from __future__ import annotations

import signal
from contextlib import contextmanager


class StopFlag:
    """Set by SIGINT/SIGTERM (``reason``: the signal's name); the loop that checks it stops at
    its next boundary. A second SIGINT raises ``KeyboardInterrupt`` at once. ``message`` is
    printed at the first signal, after the signal's name."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.reason: str | None = None

    def __call__(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        at_once = "Ctrl-C again" if signum == signal.SIGINT else "a SIGINT (Ctrl-C)"
        print(f"\n{self.reason}: {self.message} ({at_once} to stop at once)", flush=True)


@contextmanager
def stop_signals(flag: StopFlag):
    """Inside, SIGINT and SIGTERM set ``flag`` instead of raising; the handlers before are put
    back after. Off the main thread (where handlers cannot be set) the signals keep theirs."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in previous:
            signal.signal(s, flag)
    except ValueError:  # not the main thread: run without the handlers
        previous = {}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
