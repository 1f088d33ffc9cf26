"""Stage 1's data-reading part, before and after reading the source once per rank (CPU only).

Before: the progress bar counted the source once, then every shard re-read and re-parsed it to
take every num_shards-th conversation (`load_conversations` + `iter_shard`), so the work grew as
shards x dataset. After: `RankShardReader` reads it once and hands each shard its conversations.
Every old per-shard pass does the same work (a full read), so by default only --old-passes of
them are timed and the total is that mean x (shards + 1); --old-all times all of them.

    python bench/extract_data_read.py --shards 96 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.config import DataConfig  # noqa: E402
from dflash_pipe.data.sources import load_conversations  # noqa: E402
from dflash_pipe.data.stats import DataStats  # noqa: E402
from dflash_pipe.data.tokenize import iter_shard  # noqa: E402
from dflash_pipe.extract.shard_docs import RankShardReader  # noqa: E402


def old_pass(data: DataConfig, shard: int, num_shards: int) -> int:
    convs = load_conversations(data.source, data.format, data.strict, DataStats(), data.skip_samples,
                               data.max_samples)
    return sum(1 for _ in iter_shard(convs, shard, num_shards))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="embedded:sharegpt")
    ap.add_argument("--shards", type=int, default=96)
    ap.add_argument("--old-passes", type=int, default=6, help="old per-shard passes to time (then extrapolate)")
    ap.add_argument("--old-all", action="store_true", help="time every old pass instead of extrapolating")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    data = DataConfig(source=a.source)
    n = a.shards

    t = time.perf_counter()
    reader = RankShardReader(data, n, list(range(n)))
    docs_new = sum(len(reader.take(s).docs) for s in range(n))
    new_s = time.perf_counter() - t

    timed = n if a.old_all else min(n, a.old_passes)
    t = time.perf_counter()
    docs_old = sum(old_pass(data, s, n) for s in range(timed))
    per_pass = (time.perf_counter() - t) / timed
    old_s = per_pass * (n + 1)  # + the progress bar's counting pass
    if a.old_all:
        assert docs_old == docs_new, (docs_old, docs_new)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
           "source": a.source, "shards": n, "conversations": reader.selected, "docs": docs_new,
           "new_s": round(new_s, 3), "new_passes": reader.passes,
           "old_per_pass_s": round(per_pass, 3), "old_passes_timed": timed, "old_total_s": round(old_s, 2),
           "old_total_extrapolated": not a.old_all, "speedup": round(old_s / new_s, 1)}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
