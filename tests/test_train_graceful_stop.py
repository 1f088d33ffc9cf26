"""Stage 2 on SIGINT / SIGTERM: checkpoint at the current step, exit 130, no export; --resume auto is exact."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.cache_helpers import write_train_cache
from tests.fork_cli import run_cli, start_cli
from tests.test_train_resume import _losses

ROOT = Path(__file__).resolve().parents[1]
NEVER = 1000  # --checkpoint-every: no periodic checkpoint happens in these runs
ARGS = ["--drafter-num-layers", "1", "--drafter-block-size", "4", "--context-tokens", "96", "--num-anchors", "8",
        "--checkpoint-every", str(NEVER), "--loader-workers", "1", "--kd-weight", "0.3", "--lr", "3e-3"]


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_FAULT", None)
    return env


def _cmd(cache, out, extra, nproc=0):
    """nproc 0: dflash-pipe's argv for one process forked by tests/fork_cli.py; else a torchrun command."""
    argv = ["train", "--cache-dir", str(cache), "--output-dir", str(out), *ARGS, *extra]
    if not nproc:
        return argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "dflash_pipe", *argv]


def _logged_steps(out) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _workers(parent: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers (children of the launcher, RANK in their environment)."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
                if b"RANK" in env:
                    found[int(env[b"RANK"])] = int(d.name)
        except OSError:
            continue
    return found


def _interrupt(cmd, out, sig, min_logged, target=None, timeout=120):
    """Start `cmd`, send `sig` (to the worker `target(pid)` returns, else to the process) once
    `min_logged` metrics lines exist; returns (returncode, stdout, stderr). Fails instead of hanging."""
    forked = cmd[0] == "train"
    proc = (start_cli(cmd, _env()) if forked else
            subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True))
    try:
        deadline = time.time() + timeout
        while _logged_steps(out) < min_logged and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the signal was sent"
        os.kill(target(proc.pid) if target else proc.pid, sig)
        if forked:
            proc.wait(timeout)
            return (proc.returncode, *proc.output())
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        if forked:
            proc.kill()
            raise
        for pid in _workers(proc.pid).values():  # torchrun starts its workers in sessions of their own
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, stdout, stderr


def _checkpoints(out):
    return sorted(p.name for p in out.glob("ckpt-*") if (p / "COMPLETE").exists())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("graceful")
    write_train_cache(base / "cache", num_docs=40, seed=3)
    ref = run_cli(_cmd(base / "cache", base / "ref", ["--epochs", "8", "--log-every", "1"]), _env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    return base / "cache", base / "ref"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_checkpoints_the_current_step_and_resume_is_exact(tmp_path, reference, sig):
    from safetensors.torch import load_file

    cache, ref = reference
    ref_losses = _losses(ref)
    total = max(ref_losses) + 1
    run, extra = tmp_path / "run", ["--epochs", "8", "--log-every", "1"]
    rc, stdout, stderr = _interrupt(_cmd(cache, run, extra), run, sig, min_logged=3)
    assert rc == 130, stderr[-3000:]
    assert "interrupted" in stderr
    ckpts = _checkpoints(run)
    assert len(ckpts) == 1, ckpts
    stop = int(ckpts[0].split("-")[1])
    assert 3 <= stop < total and stop % NEVER != 0  # written by the stop, not by --checkpoint-every
    assert f"stopped on {sig.name} after step {stop}/{total}" in stdout
    state = json.loads((run / ckpts[0] / "state.json").read_text())
    assert state["step"] == stop and sum(state["epoch_steps"][:state["epoch"]]) + state["step_in_epoch"] == stop
    assert not (run / "export").exists()
    assert max(_losses(run)) == stop - 1  # every finished step is in the history, none after the stop

    resumed = run_cli(_cmd(cache, run, [*extra, "--resume", "auto"]), _env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stop} " in resumed.stdout
    got = _losses(run)
    assert sorted(got) == list(range(total))
    for step in range(total):
        assert got[step] == ref_losses[step], f"step {step}: {got[step]} != {ref_losses[step]}"
    a, b = load_file(str(run / "export" / "model.safetensors")), load_file(str(ref / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_ranks_stop_together_when_only_rank1_gets_sigint(tmp_path, reference):
    cache, _ = reference
    run = tmp_path / "run"
    # --log-every 2: ranks agree on a stop only at even steps (the all-reduce runs when step % log_every == 0)
    rc, stdout, stderr = _interrupt(_cmd(cache, run, ["--epochs", "8", "--log-every", "2"], nproc=2), run,
                                    signal.SIGINT, min_logged=2, target=lambda pid: _workers(pid)[1])
    assert rc != 0, stdout[-2000:]  # torchrun reports the ranks' exit 130 as a failure of its own
    # each rank exits 130; one that is still tearing down when the other has exited may get torchrun's
    # SIGTERM instead (-15): the checkpoint is complete before either rank leaves (barrier in _checkpoint)
    report = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    codes = {int(r): int(c) for r, c in report}
    assert set(codes) == {0, 1} and 130 in codes.values() and set(codes.values()) <= {130, -15}, stderr[-3000:]
    ckpts = _checkpoints(run)
    assert len(ckpts) == 1, (ckpts, stderr[-3000:])
    stop = int(ckpts[0].split("-")[1])
    assert stop % 2 == 0 and stop % NEVER != 0
    assert f"stopped on a signal to another rank after step {stop}/" in stdout  # rank 0 got no signal itself
    assert f"rank 1: stopped with the other ranks after step {stop}" in stderr
    assert not (run / "export").exists()
    assert max(_losses(run)) == stop - 1


def _deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the Python-level handler runs in the main thread at its next bytecode / here


def _sentinel(signum, frame):
    raise AssertionError("the previous handler must not run inside the block")


def _stopper(grace=0.0):
    from dflash_pipe.dist import DistInfo
    from dflash_pipe.train.graceful import GracefulStop

    return GracefulStop(torch.device("cpu"), DistInfo(), log_every=5, repeat_grace_s=grace)


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_first_signal_sets_the_flag_and_previous_handlers_come_back(first):
    before = {s: signal.signal(s, _sentinel) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _stopper() as stop:
            assert not stop.requested and not stop.should_stop(1)
            _deliver(first)
            assert stop.requested and stop.signal_name == first.name
            assert stop.should_stop(1) and stop.should_stop(3)  # one process: every step, not only log steps
        assert signal.getsignal(signal.SIGINT) is _sentinel and signal.getsignal(signal.SIGTERM) is _sentinel
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_second_signal_of_either_kind_raises_at_once_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with _stopper() as stop:
        _deliver(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # already, inside
        assert stop.should_stop(2)


def test_a_copy_of_the_first_signal_within_the_grace_time_is_not_a_second_one():
    # under torchrun a scheduler's SIGTERM arrives twice: directly and forwarded by torchrun
    with _stopper(grace=60.0) as stop:
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"


def test_outside_the_main_thread_no_handler_is_installed_and_leave_raises_a_keyboard_interrupt(capsys):
    from dflash_pipe.train.graceful import StopRequested

    before, seen = signal.getsignal(signal.SIGINT), {}

    def worker():
        with _stopper() as stop:
            seen["handler"], seen["stop"] = signal.getsignal(signal.SIGINT), stop.should_stop(5)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"handler": before, "stop": False}
    with pytest.raises(KeyboardInterrupt) as err:  # the CLI maps it to exit 130
        _stopper().leave(7, 30, Path("out"))
    assert err.type is StopRequested
    assert "after step 7/30" in capsys.readouterr().out
