"""A stand-in extractor for the window tests: replays a finished synthetic cache into a live directory
with extract's commit protocol (temp file -> rename -> sidecar), the real disk budget wait and the
real resume rule (`committed_shards`, which counts consumed shards), and extract's SIGKILL points.

    python -m tests.window_helpers STAGED LIVE MAX_CACHE_GIB K [TIMEOUT_S]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def replay(staged: Path, live: Path, max_gib: float, passes: int, timeout_s: float = 120.0) -> None:
    from dflash_pipe.cache import load_spec, try_finalize
    from dflash_pipe.cache.budget import DiskBudget
    from dflash_pipe.cache.manifest import committed_shards
    from dflash_pipe.faults import fault_point
    from dflash_pipe.io_utils import atomic_write_bytes, remove_stale_temps, temp_path_for

    live.mkdir(exist_ok=True)
    for name in ("target_head.safetensors", "cache_spec.json"):  # the spec last: the trainer waits for it
        if not (live / name).exists():
            atomic_write_bytes(live / name, (staged / name).read_bytes())
    spec = load_spec(live)
    remove_stale_temps(live)
    budget = DiskBudget(live, max_gib, passes, timeout_s, poll_s=0.05)
    done = committed_shards(live, spec)
    for i in range(spec["num_shards"]):
        if i in done:
            continue
        name = f"shard-{i:05d}-of-{spec['num_shards']:05d}"
        final = live / f"{name}.parquet"
        with budget.room_for_next_shard():
            tmp = temp_path_for(final)
            shutil.copy(staged / f"{name}.parquet", tmp)
        fault_point("extract.before_rename")
        os.replace(tmp, final)
        fault_point("extract.before_sidecar")
        atomic_write_bytes(live / f"{name}.json", (staged / f"{name}.json").read_bytes())
    fault_point("extract.before_manifest")
    try_finalize(live, spec)
    print(f"replay: done, waited {budget.waited_s:.1f}s for space", flush=True)


def env(fault: str | None = None, trace: Path | None = None) -> dict:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    e.pop("DFLASH_FAULT", None)
    e.pop("DFLASH_TRACE", None)
    if fault:
        e["DFLASH_FAULT"] = fault
    if trace:
        e["DFLASH_TRACE"] = str(trace)
    return e


def _popen(cmd, environ, log: Path):
    """Output goes to a file (a pipe nobody reads while the test polls would fill and block the child).

    cmd is a command line (a subprocess), or (function, args) for a process forked by tests/fork_cli.py
    (its own process, without the interpreter start: the kill tests' runs)."""
    if isinstance(cmd, tuple):
        from tests.fork_cli import ForkedRun

        return ForkedRun(cmd[0], cmd[1], environ, stdout_path=log)
    f = open(log, "a")
    proc = subprocess.Popen(cmd, env=environ, stdout=f, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log
    f.close()
    return proc


def start_extractor(staged: Path, live: Path, max_gib: float, passes: int, fault: str | None = None,
                    timeout_s: float = 120.0):
    """The replay extractor in a forked process (see _popen); `python -m tests.window_helpers` runs the same."""
    args = [str(staged), str(live), repr(max_gib), str(passes), str(timeout_s)]
    return _popen((replay_main, [args]), env(fault), live.parent / "extract.log")


WINDOW_TRAIN_ARGS = ["--drafter-num-layers", "1", "--drafter-block-size", "4", "--context-tokens", "96",
                     "--num-anchors", "8", "--checkpoint-every", "0", "--loader-workers", "1", "--follow",
                     "--follow-poll-s", "0.05", "--lr", "3e-3"]


def start_trainer(live: Path, out: Path, passes: int, trace: Path, fault: str | None = None, nproc: int = 1,
                  extra=()):
    """One trainer process forked (see _popen), or nproc > 1 gloo ranks under torchrun."""
    argv = ["train", "--cache-dir", str(live), "--output-dir", str(out), "--passes-per-shard", str(passes),
            *WINDOW_TRAIN_ARGS, *extra]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dflash_pipe", *argv]
    else:
        from tests.fork_cli import cli_main

        cmd = (cli_main, [argv])
    return _popen(cmd, env(fault, trace), out.parent / "train.log")


def finish(proc, timeout: float = 240) -> tuple[int, str]:
    """Wait for the process; returns (exit code, its log so far: every run of that role in this test)."""
    proc.wait(timeout=timeout)
    return proc.returncode, Path(proc.log_path).read_text()


def losses(out: Path) -> dict:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["epoch"], r["loss"], r["acc"], r["grad_norm"]) for r in recs}


def doc_passes(trace: Path, live: Path, num_shards: int, rank: int = 0) -> Counter:
    """(document, pass) -> how often a trained step read it, from the trace of the last run of each step
    (steps after the newest checkpoint are redone by a resumed run: the later line wins)."""
    from dflash_pipe.cache.window import load_ledger

    by_step = {}
    for ln in Path(f"{trace}.rank{rank}").read_text().splitlines():
        rec = json.loads(ln)
        by_step[rec["step"]] = rec
    seq_of = {shard: c for c, shard in enumerate(load_ledger(live).order())}
    out = Counter()
    for rec in by_step.values():
        for doc in rec["docs"]:
            shard = int(doc[1:]) % num_shards  # write_train_cache: document i lives in shard i % num_shards
            out[(doc, rec["epoch"] - seq_of[shard])] += 1
    return out


def replay_main(argv: list[str]) -> None:
    """STAGED LIVE MAX_CACHE_GIB K [TIMEOUT_S] (the module's command line)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    replay(Path(argv[0]), Path(argv[1]), float(argv[2]), int(argv[3]), float(argv[4]) if len(argv) > 4 else 120.0)


if __name__ == "__main__":
    replay_main(sys.argv[1:])
