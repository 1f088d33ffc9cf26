"""bench/quality_gpu.sh bg / watch: the quality run as a daemon that outlives the device call which started it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "bench" / "quality_gpu.sh"


def _driver(mode, q, out, deadline=40, **env):
    e = {**os.environ, "QUALITY_DIR": str(q), "OUT": str(out), "QUALITY_DEADLINE_S": str(deadline),
         "QUALITY_WATCH_RESERVE_S": "2", "DFLASH_PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(DRIVER), mode], env=e, capture_output=True, text=True, timeout=120)


def test_watch_on_a_machine_without_a_daemon_says_start_again(tmp_path):
    r = _driver("watch", tmp_path / "q", tmp_path / "out")
    assert r.returncode == 3 and "no background run on this machine" in r.stdout


def test_watch_reports_a_dead_daemon_and_a_finished_one(tmp_path):
    q, out = tmp_path / "q", tmp_path / "out"
    (q / "bgout").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (q / "bg.pid").write_text(f"{dead.pid}\n")
    r = _driver("watch", q, out)
    assert r.returncode == 1 and "died without an exit code" in r.stdout
    # finished: its exit code, and what it made goes home; a drafter's parts only once
    (q / "bg.rc").write_text("0\n")
    (q / "bgout" / "status.txt").write_text("done\n")
    (q / "bgout" / "drafter_lossless.tar.part-0-of-1").write_bytes(b"x" * 100)
    r = _driver("watch", q, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["drafter_lossless.tar.part-0-of-1", "status.txt"]
    out2 = tmp_path / "out2"
    r = _driver("watch", q, out2)
    assert r.returncode == 0 and sorted(p.name for p in out2.iterdir()) == ["status.txt"]


def test_watch_returns_75_at_its_deadline_while_the_daemon_runs(tmp_path):
    q, out = tmp_path / "q", tmp_path / "out"
    (q / "bgout").mkdir(parents=True)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (q / "bg.pid").write_text(f"{alive.pid}\n")
        t0 = time.monotonic()
        r = _driver("watch", q, out, deadline=6)
        assert r.returncode == 75 and "call 'bash bench/quality_gpu.sh watch' within 30 s" in r.stdout
        assert 3 <= time.monotonic() - t0 < 30
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow
def test_bg_starts_a_daemon_whose_exit_code_watch_reports(tmp_path):
    """bg copies the repo, starts `run` under setsid and watches it; here the run finds no carry (exit 3, a
    fresh machine), which must come back through bg.rc, with the daemon's own log and status."""
    q, out = tmp_path / "q", tmp_path / "out"
    r = _driver("bg", q, out, deadline=60, QUALITY_CARRY_SRC=str(tmp_path / "nothing"), QUALITY_BG_DEADLINE_S="50")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "bg: started the run in the background" in r.stdout
    assert "carry missing" in (q / "logs" / "driver.log").read_text()
    assert (q / "bg.rc").read_text().strip() == "3"
    assert (q / "repo" / "bench" / "quality_gpu.sh").is_file() and not (q / "repo" / ".git").exists()
    assert (out / "status.txt").is_file()
