"""bench/extract_parallel.py: J extract processes over disjoint shard subsets, signals passed to every job."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "extract_parallel.py"
_spec = importlib.util.spec_from_file_location("extract_parallel", SCRIPT)
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)

# a stand-in for `dflash-pipe extract`: records its --shards and sleeps (or exits with a code)
FAKE = r"""
import json, os, signal, sys, time
args = sys.argv[1:]
out, mode = args[0], args[1]
shards = args[args.index("--shards") + 1]
stopped = []
signal.signal(signal.SIGINT, lambda *a: stopped.append(1))
path = out + "." + shards.replace(",", "_")
with open(path + ".tmp", "w") as f:              # whole or absent: the test polls for these files
    json.dump({"shards": shards, "argv": args}, f)
os.replace(path + ".tmp", path)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
t0 = time.time()
while not stopped and time.time() - t0 < 30:
    time.sleep(0.05)
sys.exit(130 if stopped else 0)
"""


def test_subsets_cover_every_shard_once_and_never_read_as_a_shard_count():
    for n, jobs in ((256, 3), (7, 2), (5, 5), (3, 2)):
        parts = ep.subsets(n, jobs)
        idx = [int(i) for p in parts for i in (p.split("-")[:1] if "-" in p else p.split(","))]
        assert sorted(idx) == list(range(n)) and len(parts) == jobs
        assert all("," in p or "-" in p for p in parts)          # '5' alone would mean --num-shards 5
    assert ep.num_shards(["x", "--num-shards", "16", "--num-shards", "256"]) == 256
    assert ep.num_shards(["x", "--num-shards=8"]) == 8
    with pytest.raises(SystemExit, match="--num-shards"):
        ep.num_shards(["x", "--codec", "fp8"])


def _run(tmp_path, mode, jobs=3, n=7):
    cmd = [sys.executable, str(SCRIPT), "--jobs", str(jobs), "--", sys.executable, "-c", FAKE,
           str(tmp_path / "rec"), mode, "--num-shards", str(n)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(tmp_path):
    return sorted(json.loads(p.read_text())["shards"] for p in tmp_path.glob("rec.*") if p.suffix != ".tmp")


def test_every_job_gets_its_subset_and_a_failure_is_the_exit_status(tmp_path):
    proc = _run(tmp_path, "exit0")
    assert proc.wait(timeout=60) == 0
    assert _records(tmp_path) == ["0,3,6", "1,4", "2,5"]
    for p in tmp_path.glob("rec.*"):
        p.unlink()
    assert _run(tmp_path, "exit3").wait(timeout=60) == 3


def test_sigint_reaches_every_job_and_the_launcher_reports_the_interrupt(tmp_path):
    proc = _run(tmp_path, "sleep")
    deadline = time.time() + 30
    while len(_records(tmp_path)) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert len(_records(tmp_path)) == 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert "exit codes [130, 130, 130]" in proc.stdout.read()
