"""run_pipeline.sh's stage handling with stub stages: signals reach the running stage, the first failure wins.

The script is copied into a temporary directory next to a stub `stages/` (common.sh, extract.sh, train.sh) and a
stub interpreter that answers `-m dflash_pipe plan` with a fixed plan, so each run takes a fraction of a second
and loads no model. The stub stages are shaped like the real ones: a bash launcher that execs a Python process
(stages/common.sh), which stops on SIGINT and SIGTERM alike as `dflash-pipe extract` does (KeyboardInterrupt,
dflash_pipe/interrupts.py) and exits 130, writing `<stage>.stopped` with the signal's name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAGE = r'''
import os, signal, sys, time
stage, work = sys.argv[1], os.environ["STUB_DIR"]
got = []
def stop(signum, frame):
    got.append(signal.Signals(signum).name)
    raise KeyboardInterrupt
if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:   # as Python leaves an inherited ignore
    signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
rank = os.environ.get("RANK")
tag = stage if rank is None else f"{stage}.rank{rank}"
seconds, rc = os.environ.get(f"STUB_{stage.upper()}", "0:0").split(":")
open(os.path.join(work, f"{tag}.pid"), "w").write(str(os.getpid()))
open(os.path.join(work, f"{tag}.args"), "w").write(" ".join(sys.argv[2:]))
try:
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        time.sleep(0.02)
except KeyboardInterrupt:
    open(os.path.join(work, f"{tag}.stopped"), "w").write(",".join(got))
    sys.exit(130)
open(os.path.join(work, f"{tag}.done"), "w").write(rc)
sys.exit(int(rc))
'''

COMMON = '''set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$_repo/bin/python"
gpu_count() { echo 0; }
'''

FAKE_PY = '''#!/usr/bin/env bash
if [ "${1:-}" = -m ] && [ "${2:-}" = dflash_pipe ] && [ "${3:-}" = plan ]; then
  echo '{"stage1": "run", "summary": "stub plan"}'; exit 0
fi
exec "%s" "$@"
'''

# the stage's launcher: execs python (or torchrun), as stages/common.sh's `launch` does
LAUNCHER = '''#!/usr/bin/env bash
source "$(dirname "$0")/common.sh"
echo $$ > "$STUB_DIR/{stage}.launcher.pid"
if [ "${STUB_TORCHRUN:-}" = {stage} ]; then
  "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 --monitor-interval=0.1 \\
    "$_repo/stage.py" {stage} "$@"
else
  exec "$PY" "$_repo/stage.py" {stage} "$@"
fi
'''


@pytest.fixture
def pipe(tmp_path):
    """A copy of run_pipeline.sh beside stub stages; yields a function that starts it (Popen)."""
    root = tmp_path / "repo"
    (root / "stages").mkdir(parents=True)
    (root / "bin").mkdir()
    shutil.copy2(ROOT / "run_pipeline.sh", root / "run_pipeline.sh")
    (root / "stages" / "common.sh").write_text(COMMON)
    for stage in ("extract", "train"):
        path = root / "stages" / f"{stage}.sh"
        path.write_text(LAUNCHER.replace("{stage}", stage))
        path.chmod(0o755)
    (root / "bin" / "python").write_text(FAKE_PY % sys.executable)
    (root / "bin" / "python").chmod(0o755)
    (root / "stage.py").write_text(STAGE)
    (root / "m.toml").write_text("# stub manifest\n")
    work = tmp_path / "work"
    work.mkdir()
    procs = []

    def start(*args, sigint_ignored=False, **stub):
        """Start the pipeline with SIGINT at its default (a terminal's shell), or ignored (nohup, `&` in a script;
        also what a test runner started that way would pass on)."""
        env = {k: v for k, v in os.environ.items() if k not in ("EXTRACT_GPUS", "TRAIN_GPUS", "STRICT_GPUS")}
        env.update({"STUB_DIR": str(work), **{f"STUB_{k.upper()}": str(v) for k, v in stub.items()}})
        disposition = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
        proc = subprocess.Popen([str(root / "run_pipeline.sh"), str(root / "m.toml"), "--no-eval", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
        procs.append(proc)
        return proc

    start.work = work
    yield start
    for pid_file in work.glob("*.pid"):  # any stub left running (they hold the script's stdout and stderr)
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for proc in procs:  # a script that outlived its test
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def wait_for(path: Path, proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run_pipeline.sh exited {proc.returncode} before {path.name}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)


def finish(proc, within: float):
    """(returncode, stdout, stderr) of `proc`; fails if it runs past `within` seconds from now."""
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run_pipeline.sh still running {within} s later")
    return proc.returncode, out, err


def stage_gone(work: Path, tag: str) -> bool:
    try:
        os.kill(int((work / f"{tag}.pid").read_text()), 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_reaches_the_running_stage_and_the_pipeline_exits_130_at_once(pipe, sig):
    """The stage used to inherit SIGINT ignored and the script's `kill -INT` reached only the stage's bash
    launcher: the pipeline said "interrupted" and then waited for the stage to do all its work."""
    proc = pipe(extract="60:0")
    wait_for(pipe.work / "extract.pid", proc)
    proc.send_signal(sig)
    rc, _, err = finish(proc, within=10)
    assert rc == 130, err
    assert (pipe.work / "extract.stopped").read_text() == "SIGTERM" and not (pipe.work / "extract.done").exists()
    assert not (pipe.work / "train.pid").exists(), "stage 2 started after an interrupt"
    assert "interrupted" in err and stage_gone(pipe.work, "extract")


def test_a_pipeline_started_with_sigint_ignored_still_stops_its_stages_on_sigterm(pipe):
    """nohup / `&` in a script start the pipeline with SIGINT ignored, which its stages inherit and no handler can
    undo: the forwarded signal is SIGTERM, so a scheduler's SIGTERM still stops both stages cleanly (a forwarded
    SIGINT left them running to the end; CI's runner, started that way, showed it)."""
    proc = pipe("--follow", extract="60:0", train="60:0", sigint_ignored=True)
    wait_for(pipe.work / "extract.pid", proc)
    wait_for(pipe.work / "train.pid", proc)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc, within=10)
    assert rc == 130, err
    assert (pipe.work / "extract.stopped").read_text() == "SIGTERM" == (pipe.work / "train.stopped").read_text()
    assert stage_gone(pipe.work, "extract") and stage_gone(pipe.work, "train")


def test_sigint_during_follow_stops_both_stages(pipe):
    proc = pipe("--follow", extract="60:0", train="60:0")
    wait_for(pipe.work / "extract.pid", proc)
    wait_for(pipe.work / "train.pid", proc)
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc, within=10)
    assert rc == 130, err
    assert (pipe.work / "extract.stopped").exists() and (pipe.work / "train.stopped").exists()
    assert stage_gone(pipe.work, "extract") and stage_gone(pipe.work, "train")


@pytest.mark.slow
def test_sigint_reaches_torchrun_launched_train_workers(pipe):
    """stages/common.sh launches train on GPUs with torchrun, whose workers run in sessions of their own: the
    signal reaches torchrun through the stage's process group and torchrun forwards it to every worker."""
    pytest.importorskip("torch")
    proc = pipe(extract="0:0", train="120:0", torchrun="train")
    for rank in (0, 1):
        wait_for(pipe.work / f"train.rank{rank}.pid", proc, timeout=120)
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc, within=40)  # torchrun SIGKILLs workers 30 s after forwarding; they take ms here
    assert rc == 130, err
    for rank in (0, 1):
        assert (pipe.work / f"train.rank{rank}.stopped").exists(), err
        assert stage_gone(pipe.work, f"train.rank{rank}")


@pytest.mark.parametrize("first,other", [("train", "extract"), ("extract", "train")])
def test_follow_the_first_stage_to_fail_stops_the_other_and_gives_its_exit_code(pipe, first, other):
    """train failing first used to wait for extract (which under a disk budget waits for space up to
    --space-wait-timeout-s, then exits 4) and then report extract's failure, not train's."""
    code = {"train": 3, "extract": 4}[first]
    proc = pipe("--follow", **{first: f"0.3:{code}", other: "60:0"})
    rc, _, err = finish(proc, within=10)
    assert rc == code, err
    name = {"train": "stage 2 (train --follow)", "extract": "stage 1 (extract)"}[first]
    assert f"{name} failed first (exit {code})" in err, err
    assert (pipe.work / f"{other}.stopped").exists(), f"{other} was not stopped"
    assert stage_gone(pipe.work, other)


def test_follow_extract_done_first_lets_train_finish(pipe):
    proc = pipe("--follow", extract="0.1:0", train="1.0:0")
    rc, out, err = finish(proc, within=20)
    assert rc == 0 and "run_pipeline: done" in out, err
    assert (pipe.work / "extract.done").exists() and (pipe.work / "train.done").exists()
    assert (pipe.work / "train.args").read_text().split()[-1] == "--follow"


def test_sequential_stage_failure_gives_its_exit_code_and_stage_2_does_not_start(pipe):
    proc = pipe(extract="0:4", train="0:0")
    rc, _, err = finish(proc, within=20)
    assert rc == 4 and "stage 1 (extract) failed (exit 4)" in err, err
    assert not (pipe.work / "train.pid").exists()


def test_help_prints_the_header_comment_only():
    out = subprocess.run([str(ROOT / "run_pipeline.sh"), "--help"], capture_output=True, text=True, timeout=30).stdout
    lines = out.splitlines()
    assert lines and all(line.startswith("#") for line in lines), out  # it printed `set -euo pipefail` and `cd`
    assert "130" in out and "--follow" in out
