"""Run one `dflash-pipe extract` command as J processes over disjoint shard subsets, on the same device.

For a small target (SmolLM2-135M) one extract process is host-bound, not GPU-bound: its single writer
thread (parquet pages, sha256, fsync) and the tokenizer on its main thread cap it at ~70-140 k tok/s
(profiled on the CPU box, 2026-12-04) while the H200 forward runs ~10x that. J processes multiply the
writers, tokenizers and GILs; the cache is one directory, as with separate `--shards` jobs on separate
GPUs (each job counts its own in-flight shard against --max-cache-gib under the cache's lock, and the
last job to finish writes the manifest).

    python bench/extract_parallel.py --jobs 3 -- python -m dflash_pipe extract ... --num-shards 256

Job j gets `--shards` = every J-th shard from j (appended last, so it wins). SIGINT / SIGTERM are passed
to every job (each stops after committing what it has; a rerun resumes). Exit status: 0 when every job
exited 0; else the first non-zero status among interrupted (130) or failed jobs, failures first.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time


def num_shards(cmd: list[str]) -> int:
    """The command's last --num-shards value (required: the subsets are cut from it)."""
    n = None
    for i, a in enumerate(cmd):
        if a == "--num-shards" and i + 1 < len(cmd):
            n = int(cmd[i + 1])
        elif a.startswith("--num-shards="):
            n = int(a.split("=", 1)[1])
    if n is None:
        raise SystemExit("extract_parallel.py: the extract command needs an explicit --num-shards N")
    return n


def subsets(n: int, jobs: int) -> list[str]:
    """Every jobs-th shard index from j, as extract's --shards text (a lone index as 'i-i': a plain integer
    would mean --num-shards)."""
    out = []
    for j in range(jobs):
        idx = list(range(j, n, jobs))
        out.append(f"{idx[0]}-{idx[0]}" if len(idx) == 1 else ",".join(map(str, idx)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the extract command")
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd or a.jobs < 1:
        p.error("need --jobs >= 1 and an extract command after --")
    n = num_shards(cmd)
    jobs = min(a.jobs, n)
    procs = [subprocess.Popen([*cmd, "--shards", s]) for s in subsets(n, jobs)]
    print(f"extract_parallel: {jobs} jobs over {n} shards, pids {[q.pid for q in procs]}", flush=True)

    def forward(signum, _frame):
        for q in procs:
            if q.poll() is None:
                q.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    while any(q.poll() is None for q in procs):
        time.sleep(0.5)
    codes = [q.returncode for q in procs]
    print(f"extract_parallel: exit codes {codes}", flush=True)
    failed = [c for c in codes if c not in (0, 130, -signal.SIGINT)]
    if failed:
        return failed[0] if failed[0] > 0 else 1
    return 130 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
