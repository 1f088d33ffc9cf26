"""Paired comparisons of eval runs from their per-prompt records (eval_prompts.jsonl, or the .jsonl.gz copies kept
in bench/results/): one method of run A against one of run B on the prompts both decoded (tau = tokens committed
by verify steps / steps, pooled; 95 % bootstrap over prompts, bench/quality_summary.paired), optionally on the
prompts of a third run only, and a split of run B's prompts by prompt lookup's own tau there.

    # session 14's KD drafter against session 13's, held-out; then on session 6's 20 prompts only
    python bench/eval_compare.py bench/results/2026-12-04-h200-session13/eval-heldout-prompts.jsonl.gz \
        bench/results/2026-12-04-h200-session14/eval-heldout-prompts.jsonl.gz --b dflash:var-kd --split-lookup 1.6
    python bench/eval_compare.py S6.jsonl.gz S14.jsonl.gz --only-ids-of S6.jsonl.gz
Sample ids are compared without a `#k` sample suffix (runs regenerated with several samples name the held-out
prompts <id>#0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lookup_compare import lookup_split, pooled_tau, turn_split  # noqa: E402
from quality_summary import _counts, paired  # noqa: E402


def rows(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        out = [json.loads(line) for line in f if line.strip()]
    for r in out:
        r["id"] = re.sub(r"#\d+$", "", r["id"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="run A's per-prompt records")
    ap.add_argument("b", help="run B's per-prompt records")
    ap.add_argument("--a-method", default="dflash:lossless")
    ap.add_argument("--b", dest="b_method", default="dflash:lossless", help="run B's method")
    ap.add_argument("--only-ids-of", default="", help="compare on the prompts of this run's records only")
    ap.add_argument("--split-lookup", type=float, default=0.0,
                    help="also split run B's prompts at this prompt-lookup tau (its n-gram records)")
    args = ap.parse_args()
    a, b = _counts(rows(args.a)), _counts(rows(args.b))
    ca, cb = a[args.a_method], b[args.b_method]
    if args.only_ids_of:
        keep = set(_counts(rows(args.only_ids_of))[args.a_method])
        ca, cb = {k: v for k, v in ca.items() if k in keep}, {k: v for k, v in cb.items() if k in keep}
    ids = sorted(set(ca) & set(cb))
    p = paired(ca, cb)
    out = {"prompts": len(ids), "tau_a": pooled_tau(ca, ids), "tau_b": pooled_tau(cb, ids), "b_vs_a": p["diff"],
           "ci95": p["ci95"]}
    if "ngram" in b:
        out["lookup_tau_b"] = pooled_tau(b["ngram"], [i for i in ids if i in b["ngram"]])
    by_turn = turn_split({"ngram": b.get("ngram", {}), args.b_method: cb}, args.b_method)
    if by_turn:
        out["b_by_turn"] = by_turn
    if args.split_lookup:
        split = lookup_split({"ngram": b["ngram"], args.b_method: cb}, args.b_method, args.split_lookup)
        for side in ("below", "at_or_above"):
            out[f"lookup_{side}_{args.split_lookup}"] = split[side]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
