"""Why session 8's window run sized its LR schedule short (issue #16): a CPU reconstruction, no target model.

`bench/window_quality.py`'s H200 window run had 1,087 steps and a cosine sized for 1,058. That estimate
(WindowCoordinator.estimate_total_steps until the LR curve moved to shard passes, train/window_lr.py) took the first
shard's tokens and greedy-packing fill as every shard's. This rebuilds the run's round schedules from the
conversations it trained on (the seed's SmolLM2 answers, the same 14,681 the quality run regenerated; after the 300
held out, 4,000 in 16 shards, i % 16; chat template, cut to --max-length) and prints the real step count, the old
estimate, the per-shard tokens and what train/window_lr.planned_total says at round 0 (display only now).

    python bench/window_steps_estimate.py      # ~10 s: real 1085, old estimate 1058, shard 0 -1.8 % of the mean
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.train.schedule import build_round_schedule, window_members, window_rounds  # noqa: E402
from dflash_pipe.train.window_lr import planned_total  # noqa: E402


def old_estimate(sched, rounds: int, passes: int, n: int, S: int) -> int:
    """The removed estimator: round 0 (the first shard alone) extrapolated to every round."""
    batches = sched.per_rank[0]
    tokens = sum(d.num_tokens for b in batches for d in b)
    full = batches[:-1] or batches
    fill = sum(d.num_tokens for b in full for d in b) / max(1, len(full) * S)
    per_shard = tokens / max(1.0, fill * S)
    return max(1, sum(max(1, math.ceil(len(window_members(r, passes, n)) * per_shard)) for r in range(rounds)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT / "bench/data/smollm2_regenerated_sharegpt.jsonl.gz"))
    ap.add_argument("--heldout", type=int, default=300)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--model-cache", default="~/.cache/dflash-pipe/models")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_tokenizer_dir(Path(a.model_cache).expanduser())),
                                        local_files_only=True)
    rows = [json.loads(line) for line in gzip.open(a.data, "rt")][a.heldout:a.heldout + a.samples]
    lens = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"], tokenize=True)
        lens.append(min(len(ids["input_ids"] if hasattr(ids, "keys") else ids), a.max_length))
    n, K, S = 4 * a.passes, a.passes, a.context_tokens
    lengths = {c: [lens[c::n]] for c in range(n)}  # one row group per shard: world 1 deals none
    order, rounds = list(range(n)), window_rounds(K, n)
    steps = [build_round_schedule(lengths, order, r, K, n, 1, 0, S, 256).steps for r in range(rounds)]
    shard_tokens = [sum(v[0]) for v in lengths.values()]
    mean = sum(shard_tokens) / n
    out = {"real_steps": sum(steps),
           "old_estimate": old_estimate(build_round_schedule(lengths, order, 0, K, n, 1, 0, S, 256), rounds, K, n, S),
           "planned_total_at_round_0": planned_total(0, steps[0], 0, K, n), "round_steps": steps,
           "shard_tokens": shard_tokens, "shard0_vs_mean": round(shard_tokens[0] / mean - 1, 4),
           "shard_sd": round((sum((x - mean) ** 2 for x in shard_tokens) / n) ** 0.5 / mean, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
