"""Stream stage 1 into stage 2 within a disk budget, both on one device (issue #16's measurement).

Runs `dflash-pipe extract --max-cache-gib B` and `dflash-pipe train --follow --passes-per-shard K` at
the same time on the same GPU (or the CPU with --smoke), samples the cache directory's disk usage every
--sample-s seconds, and writes a JSON summary:

  * high-water mark of the shard bytes (committed + in-flight temp files) against the budget;
  * bytes and tokens streamed through the window, as a multiple of the budget;
  * the trainer's data-wait share of step time once the window is full (rounds >= K - 1), measured as in
    session 7: per step, data_wait = host time the step loop waited for its batch (the loader's next batch,
    and the wait inside the step for the one after it) plus, on a round's first step, the time `wait_round`
    took (waiting for the round's shards to be committed); step_s = wall time from the end of the previous
    step (or the start of the round, after the boundary's checkpoint) to the end of this one (CUDA
    synchronised); share = sum(data_wait * step_s) / sum(step_s) over the steps of rounds >= K - 1;
  * that share split into its two causes: `shard_wait` (the trainer waited for extraction to commit the
    round's shards: extraction is the slower stage) and the rest (the loader was late: what read-ahead and
    cheap round boundaries address), and the share over the rounds that did not wait for a shard at all;
  * the round boundaries: time outside the steps, and the background checkpoints' snapshot / write times;
  * the time extraction spent waiting for space, and the wall time of both stages.

    # H200 (issue #16): 64 shards of ~110 docs (~7 steps a round), budget 0.6 GiB, a checkpoint every 2 rounds

    python bench/window_stream.py --json OUT.json             # H200: SmolLM2 + ShareGPT, 0.6 GiB budget
    python bench/window_stream.py --smoke --json OUT.json     # CPU toy size (tiny random target)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.config import load_manifest, normalize, to_toml  # noqa: E402

GIB = 1 << 30


def sample_disk(cache: Path, stop: threading.Event, every_s: float, out: dict) -> None:
    """Shard bytes (committed + temp) and the whole directory, every `every_s` seconds."""
    out.update(high_shards=0, high_dir=0, samples=0, over_budget_samples=0)
    while not stop.is_set():
        shards = total = 0
        try:
            for p in cache.iterdir():
                try:
                    size = p.stat().st_size
                except FileNotFoundError:
                    continue
                total += size
                if (p.name.startswith("shard-") and p.name.endswith(".parquet")) or p.name.startswith(".shard-"):
                    shards += size
        except FileNotFoundError:
            pass
        out["high_shards"] = max(out["high_shards"], shards)
        out["high_dir"] = max(out["high_dir"], total)
        out["samples"] += 1
        if out.get("budget") and shards > out["budget"]:
            out["over_budget_samples"] += 1
        stop.wait(every_s)


def by_round(recs: list[dict]) -> dict[int, list[dict]]:
    """metrics.jsonl rows grouped by round (their `epoch`), in step order."""
    rounds: dict[int, list[dict]] = {}
    for r in recs:
        rounds.setdefault(r["epoch"], []).append(r)
    return rounds


def wait_split(recs: list[dict]) -> dict:
    """The step-time-weighted data-wait share of `recs` (metrics.jsonl rows), split into waiting for a shard to
    be committed (`shard_wait`, window mode) and the rest, and the share over rounds that never waited for one."""
    out = dict(share=None, shard_share=None, loader_share=None, rounds=0, rounds_no_shard_wait=0,
               share_no_shard_wait=None)
    total = sum(r["step_s"] for r in recs)
    if not recs or total <= 0:
        return out
    wait = sum(r["data_wait"] * r["step_s"] for r in recs)
    shard = sum(r.get("shard_wait", 0.0) * r["step_s"] for r in recs)
    rounds = by_round(recs)
    calm = [r for rs in rounds.values() if sum(x.get("shard_wait", 0.0) * x["step_s"] for x in rs) < 1e-3 for r in rs]
    calm_s = sum(r["step_s"] for r in calm)
    out.update(share=wait / total, shard_share=shard / total, loader_share=(wait - shard) / total, rounds=len(rounds),
               rounds_no_shard_wait=len({r["epoch"] for r in calm}),
               share_no_shard_wait=sum(r["data_wait"] * r["step_s"] for r in calm) / calm_s if calm_s else None)
    return out


def wait_by_position(recs: list[dict], edge: int = 3) -> dict:
    """Where in a round the loader's wait (data-wait less shard wait) falls, as shares of all step time:
    the round's first step (the boundary's look, schedule and first batch), its next `edge - 1`, its last
    `edge` (the read-ahead of the next round runs then) and the middle. Tells a slow boundary from a slow
    loader."""
    total = sum(r["step_s"] for r in recs)
    out = {"first": 0.0, "early": 0.0, "middle": 0.0, "last": 0.0}
    if total <= 0:
        return out
    for rs in by_round(recs).values():
        for i, r in enumerate(rs):
            wait = (r["data_wait"] - r.get("shard_wait", 0.0)) * r["step_s"]
            key = "first" if i == 0 else "early" if i < edge else "last" if i >= len(rs) - edge else "middle"
            out[key] += wait / total
    return out


def data_file(source: str, work: Path) -> str:
    """A .jsonl.gz is decompressed into the work dir (the readers take plain files)."""
    if not source.endswith(".gz"):
        return source
    import gzip
    import shutil

    out = work / Path(source).name[:-3]
    if not out.exists():
        with gzip.open(source, "rb") as src, open(f"{out}.tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(f"{out}.tmp", out)
    return str(out)


def build_manifest(a, work: Path) -> Path:
    cfg = load_manifest(ROOT / "manifests" / ("tiny-qwen3.5.toml" if a.smoke else "default.toml"))
    ex, tr, d = cfg.extract, cfg.train, cfg.data
    d.source, d.format = data_file(a.data, work), "auto"
    d.skip_samples, d.max_samples = a.skip_samples, a.samples
    if a.model_cache_dir:
        cfg.target.model_cache_dir = a.model_cache_dir
    cfg.drafter.attention, tr.compile = a.attention, a.compile
    ex.cache_dir, ex.num_shards, ex.max_length, ex.token_budget = str(work / "cache"), a.shards, a.max_length, a.token_budget
    ex.max_cache_gib, ex.space_wait_timeout_s = a.budget_gib, a.space_timeout_s
    if a.compress_workers:
        ex.compress_workers = a.compress_workers
    tr.output_dir, tr.follow, tr.passes_per_shard = str(work / "train"), True, a.passes
    tr.follow_poll_s, tr.follow_timeout_s = 0.2, a.space_timeout_s
    tr.window_checkpoint_rounds = a.checkpoint_rounds
    tr.window_read_ahead, tr.window_async_checkpoint = not a.no_read_ahead, not a.sync_checkpoint
    if a.drafter_layers:
        cfg.drafter.num_layers = a.drafter_layers
    tr.context_tokens, tr.num_anchors, tr.max_anchors_per_doc = a.context_tokens, a.num_anchors, a.num_anchors
    tr.checkpoint_every, tr.log_every, tr.loader_workers = 0, 1, a.loader_workers
    if a.loader_prefetch:
        tr.loader_prefetch = a.loader_prefetch
    if a.loader_read_ahead is not None:
        tr.loader_read_ahead = a.loader_read_ahead
    normalize(cfg)
    path = work / "window_stream.toml"
    path.write_text(to_toml(cfg))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU toy size: tiny random target, a few hundred KB")
    p.add_argument("--work", default="", help="work directory (default: a fresh one under /tmp)")
    p.add_argument("--json", default="", help="write the summary here")
    p.add_argument("--budget-gib", type=float, default=None)
    p.add_argument("--passes", type=int, default=2, help="K: reads of every shard")
    p.add_argument("--no-read-ahead", action="store_true", help="[train] window_read_ahead = false (session 7's loader)")
    p.add_argument("--sync-checkpoint", action="store_true", help="[train] window_async_checkpoint = false")
    p.add_argument("--drafter-layers", type=int, default=0, help="[drafter] num_layers (0 = the manifest's)")
    p.add_argument("--checkpoint-rounds", type=int, default=None, help="[train] window_checkpoint_rounds M (the "
                   "budget must hold K + M shards)")
    p.add_argument("--shards", type=int, default=None)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--skip-samples", type=int, default=300)
    p.add_argument("--data", default=str(ROOT / "bench" / "data" / "smollm2_regenerated_sharegpt.jsonl.gz"),
                   help="conversations to extract, JSONL or .jsonl.gz (default: the SmolLM2-regenerated ShareGPT "
                   "first turns kept in bench/data; the GPU image lacks the sharegpt package)")
    p.add_argument("--model-cache-dir", default="", help="[target] model_cache_dir (quality_gpu.sh passes its own)")
    p.add_argument("--attention", default="sdpa", help="drafter attention (sdpa: no compile time in the budget)")
    p.add_argument("--compile", default="off", help="[train] compile")
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--num-anchors", type=int, default=None)
    p.add_argument("--loader-workers", type=int, default=None)
    p.add_argument("--loader-prefetch", type=int, default=0, help="[train] loader_prefetch (0 = the manifest's)")
    p.add_argument("--loader-read-ahead", type=int, default=None, help="[train] loader_read_ahead (0 = row groups "
                   "read on demand, the loader before session 10)")
    p.add_argument("--compress-workers", type=int, default=0)
    p.add_argument("--space-timeout-s", type=float, default=300.0)
    p.add_argument("--sample-s", type=float, default=0.2)
    p.add_argument("--limit-s", type=float, default=420.0, help="kill both stages after this long")
    a = p.parse_args()
    smoke = dict(budget_gib=0.0016, shards=16, samples=64, max_length=256, token_budget=1024, context_tokens=512,
                 num_anchors=32, loader_workers=1, checkpoint_rounds=2)
    # session 7 (4,000 conversations in 96 shards of ~41 docs, 0.3 GiB) made ~2 steps a round: the boundary
    # dominated. 7,000 conversations x ~265 tokens x ~3.9 KB/token ~ 6.8 GiB = ~11x the budget, in 64 shards of
    # ~110 docs / ~29 k tokens (~7 steps of 8,192 tokens a round at K = 2); the budget holds ~5.6 shards of
    # ~107 MB, K + M = 3 needed. M = 1 (the trainer's default): with M = 2 a budget of K + M shards frees space
    # every other round only, and the trainer waits for the shard extraction could not write (session 10: 2.7 %)
    h200 = dict(budget_gib=0.6, shards=64, samples=7000, max_length=512, token_budget=16384,
                context_tokens=8192, num_anchors=512, loader_workers=6, checkpoint_rounds=1)
    for k, v in (smoke if a.smoke else h200).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    work = Path(a.work) if a.work else Path(f"/tmp/window_stream-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    manifest = build_manifest(a, work)
    cache = work / "cache"
    cache.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    dev = ["--device", "cpu"] if a.smoke else []
    disk = {"budget": int(a.budget_gib * GIB)}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_disk, args=(cache, stop, a.sample_s, disk), daemon=True)
    sampler.start()
    t0 = time.time()
    with open(work / "extract.log", "w") as le, open(work / "train.log", "w") as lt:
        ext = subprocess.Popen([sys.executable, "-m", "dflash_pipe", "extract", "-m", str(manifest), *dev],
                               env=env, stdout=le, stderr=subprocess.STDOUT)
        while not (cache / "cache_spec.json").exists() and ext.poll() is None:
            time.sleep(0.2)
        trn = subprocess.Popen([sys.executable, "-m", "dflash_pipe", "train", "-m", str(manifest), *dev],
                               env=env, stdout=lt, stderr=subprocess.STDOUT)
        walls = {}
        while len(walls) < 2:
            for name, proc in (("extract", ext), ("train", trn)):
                if name not in walls and proc.poll() is not None:
                    walls[name] = time.time() - t0
            if ext.poll() not in (None, 0) and trn.poll() is None:
                trn.send_signal(signal.SIGINT)  # extraction failed: the trainer checkpoints and stops
                trn.wait()
            if time.time() - t0 > a.limit_s:
                for proc in (ext, trn):
                    if proc.poll() is None:
                        proc.kill()
                break
            time.sleep(0.2)
    stop.set()
    sampler.join()
    ext_log, trn_log = (work / "extract.log").read_text(), (work / "train.log").read_text()
    m = re.search(r"([\d.]+)s waiting for the window trainer", ext_log)
    space_wait = float(m.group(1)) if m else None
    sides = [json.loads(p.read_text()) for p in sorted(cache.glob("shard-*.json"))]
    streamed_bytes, streamed_tokens = sum(s["bytes"] for s in sides), sum(s["tokens"] for s in sides)
    recs = [json.loads(ln) for ln in (work / "train" / "metrics.jsonl").read_text().splitlines()] \
        if (work / "train" / "metrics.jsonl").exists() else []
    full = [r for r in recs if r["epoch"] >= a.passes - 1]
    waits = wait_split(full)
    # the training loader's row-group reads (the first 'loader:' line: it closes before a validation loader)
    reads = re.findall(r"loader: (\d+) row groups read \((\d+) ahead, (\d+) on demand\); decode workers spent "
                       r"([\d.]+)s", trn_log)
    ckpts = [(float(x), float(y)) for x, y in re.findall(r"snapshot (\d+) ms on the step loop, write (\d+) ms", trn_log)]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": a.smoke,
        "returncodes": {"extract": ext.returncode, "train": trn.returncode},
        "budget_gib": a.budget_gib, "passes_per_shard": a.passes, "checkpoint_rounds": a.checkpoint_rounds,
        "read_ahead": not a.no_read_ahead, "async_checkpoint": not a.sync_checkpoint,
        "num_shards": a.shards, "samples": a.samples,
        "shards_committed": len(sides), "shard_bytes_max": max((s["bytes"] for s in sides), default=0),
        "high_water_shards_gib": disk["high_shards"] / GIB, "high_water_dir_gib": disk["high_dir"] / GIB,
        "within_budget": disk["high_shards"] <= disk["budget"], "disk_samples": disk["samples"],
        "over_budget_samples": disk["over_budget_samples"],
        "streamed_gib": streamed_bytes / GIB, "streamed_tokens": streamed_tokens,
        "streamed_over_budget": streamed_bytes / max(1, disk["budget"]),
        "train_steps": len(recs), "train_steps_window_full": len(full),
        "train_data_wait_share_window_full": waits["share"],
        "train_shard_wait_share_window_full": waits["shard_share"],  # of it: waiting for extraction to commit
        "train_loader_wait_share_window_full": waits["loader_share"],  # of it: the loader was late
        "rounds_window_full": waits["rounds"], "rounds_without_shard_wait": waits["rounds_no_shard_wait"],
        "train_data_wait_share_rounds_without_shard_wait": waits["share_no_shard_wait"],
        "train_loader_wait_share_by_round_position": wait_by_position(full),
        "row_groups_read": dict(zip(("total", "ahead", "on_demand", "worker_wait_s"),
                                    (*map(int, reads[0][:3]), float(reads[0][3])))) if reads else None,
        "steps_per_round": len(recs) / max(1, len({r["epoch"] for r in recs})),
        "background_checkpoints": len(ckpts),
        "checkpoint_snapshot_ms_mean": sum(c[0] for c in ckpts) / len(ckpts) if ckpts else None,
        "checkpoint_write_ms_mean": sum(c[1] for c in ckpts) / len(ckpts) if ckpts else None,
        "train_tok_s_window_full": (sum(r["tok_s"] * r["step_s"] for r in full) / sum(r["step_s"] for r in full))
        if full else None,
        # wall time of the trainer outside its steps: start-up, the round-boundary checkpoints and deletions
        "train_step_s_sum": sum(r["step_s"] for r in recs),
        "train_outside_steps_s": (walls["train"] - sum(r["step_s"] for r in recs)) if "train" in walls else None,
        "extract_space_wait_s": space_wait, "extract_wall_s": walls.get("extract"), "train_wall_s": walls.get("train"),
        "work": str(work),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
        if recs:  # the per-step timing rows beside the summary (gzipped), for a look at where the waits fall
            import gzip

            keep = ("step", "epoch", "step_s", "data_wait", "shard_wait", "tok_s", "loss")
            with gzip.open(Path(a.json).with_name(Path(a.json).stem + "_steps.jsonl.gz"), "wt") as f:
                for r in recs:
                    f.write(json.dumps({k: round(r[k], 6) if isinstance(r[k], float) else r[k]
                                        for k in keep if k in r}) + "\n")
    if ext.returncode or trn.returncode:
        print("--- extract log tail\n" + ext_log[-3000:] + "\n--- train log tail\n" + trn_log[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
