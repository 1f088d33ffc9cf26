"""Run a command and Ctrl-C (or SIGTERM) it once its first shard is committed (shared by the interrupt tests)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest


def interrupt_after_first_shard(cmd: list[str], env: dict, cache: Path, what: str, forked: bool = False,
                                sig: int = signal.SIGINT) -> str:
    """Start `cmd`, send `sig` (SIGINT or SIGTERM) when a shard sidecar appears in `cache`; returns stderr.

    forked=True: `cmd` is dflash-pipe's argv, run in a process forked from tests/fork_cli.py's server.
    Skips the calling test if the command finished before the interrupt landed; asserts exit 130.
    """
    if forked:
        from tests.fork_cli import start_cli

        proc = start_cli(cmd, env)
    else:
        # SIGINT at its default, as a terminal's shell starts a command, even where the test runner was started
        # with it ignored (nohup, `&`): an ignored SIGINT is inherited and no handler can undo it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while not list(cache.glob("shard-*.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(sig)
    if forked:
        proc.wait(timeout=120)
        err = proc.output()[1]
    else:
        _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip(f"{what} finished before the interrupt landed")
    assert proc.returncode == 130, f"exit {proc.returncode}: {err[-2000:]}"
    assert "interrupted" in err
    return err
