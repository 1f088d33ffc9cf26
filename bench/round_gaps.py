"""How much of a window trainer's wall time its round boundaries took, from metrics.jsonl alone.

Runs before round_clock.py (window_rounds.jsonl) recorded nothing at the boundaries; their metrics.jsonl still has
each logged step's wall-clock `time` and `epoch` (= round in window mode). Between two logged steps of the same round
the wall time per step is the loop's own; an interval that crosses a round boundary takes longer by what the
boundary cost. Validation passes (every --val-every steps) are left out.

    python bench/round_gaps.py /tmp/r24/quality/train-lossless/metrics.jsonl --val-every 1000
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path


def round_gaps(records: list[dict], val_every: int = 0) -> dict:
    inside, crossing = [], []
    for a, b in zip(records, records[1:]):
        n, dt = b["step"] - a["step"], b["time"] - a["time"]
        if n <= 0:
            continue
        if val_every and (a["step"] + 1) // val_every != (b["step"] + 1) // val_every:
            continue  # a validation pass ran in this interval
        (crossing if b["epoch"] != a["epoch"] else inside).append((dt, n))
    per_step = st.median(dt / n for dt, n in inside) if inside else float("nan")
    extra = [dt - n * per_step for dt, n in crossing]
    span = records[-1]["time"] - records[0]["time"] if len(records) > 1 else 0.0
    return {"steps": records[-1]["step"] - records[0]["step"] if records else 0, "span_s": round(span, 1),
            "step_ms_inside_rounds": round(per_step * 1e3, 1), "boundaries": len(crossing),
            "boundary_extra_s_median": round(st.median(extra), 3) if extra else None,
            "boundary_extra_s_total": round(sum(extra), 1),
            "share_of_span": round(sum(extra) / span, 3) if span else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", type=Path)
    ap.add_argument("--val-every", type=int, default=0, help="the run's --val-every (its validation intervals are skipped)")
    args = ap.parse_args()
    recs = [json.loads(ln) for ln in args.metrics.read_text().splitlines() if ln.strip()]
    print(json.dumps(round_gaps(recs, args.val_every), indent=1))


if __name__ == "__main__":
    main()
