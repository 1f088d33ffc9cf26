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


def test_watch_sends_a_running_trainers_newest_checkpoint_home_at_most_every_interval(tmp_path):
    """A machine lost mid-pass (session 22: 450 steps before the end) costs the steps after the last checkpoint
    sent home, not the pass: the watch exports the newest one into $OUT/partial/ and it unpacks as a drafter."""
    from tests.test_bench_drafter_parts import _checkpoint, dp
    q = tmp_path / "q"
    (q / "bgout").mkdir(parents=True)
    _checkpoint(q / "train-lossless", 30, seed=1)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (q / "bg.pid").write_text(f"{alive.pid}\n")
        out = tmp_path / "out1"
        r = _driver("watch", q, out, deadline=6)
        assert r.returncode == 75, r.stdout + r.stderr
        dest = tmp_path / "home" / "export"
        dp.unpack(out / "partial", "lossless", dest)
        assert '"step": 30' in (dest / "PARTIAL.json").read_text() and (dest / "model.safetensors").is_file()
        _checkpoint(q / "train-lossless", 60, seed=2)
        out = tmp_path / "out2"                                    # within QUALITY_PARTIAL_HOME_S: nothing again
        assert _driver("watch", q, out, deadline=6).returncode == 75 and not (out / "partial").exists()
        out = tmp_path / "out3"                                    # the interval passed: the newer one goes
        assert _driver("watch", q, out, deadline=6, QUALITY_PARTIAL_HOME_S="1").returncode == 75
        dp.unpack(out / "partial", "lossless", dest)
        assert '"step": 60' in (dest / "PARTIAL.json").read_text()
        (q / "train-lossless" / "export").mkdir()                  # finished: its real export goes, not a partial
        (q / "train-lossless" / "export" / "config.json").write_text("{}")
        out = tmp_path / "out4"
        assert _driver("watch", q, out, deadline=6, QUALITY_PARTIAL_HOME_S="1").returncode == 75
        assert not (out / "partial").exists()
    finally:
        alive.kill()
        alive.wait()
