"""SIGTERM stops `extract` and `eval` the way Ctrl-C does.

Python turns SIGINT into KeyboardInterrupt, and those stages stop cleanly on it (extract aborts its writer
thread and leaves only committed shards, eval keeps its progress log; the CLI exits 130, errors.py). SIGTERM
(a scheduler's preemption, `kill`, `timeout`) has no handler by default and ended them by the signal (exit
-15 / 143, no cleanup). Inside `with sigterm_as_interrupt():` SIGTERM raises the same KeyboardInterrupt;
the previous handler is restored when the block exits. Main thread only (elsewhere nothing is installed),
and a SIGTERM that was ignored (SIG_IGN, inherited) stays ignored, as Python leaves an ignored SIGINT.
`train` has its own graceful stop (train/graceful.py).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not set from Python
