"""Simulate regenerate's refill policy (regen_refill.plan_refill) under the H200's measured costs: no GPU needed.

Slots, prompts and answers as in `bench/regen_throughput.py` (SmolLM2's own answers to ShareGPT first turns,
`bench/data/smollm2_regenerated_sharegpt.jsonl.gz`: prompt lengths from the chat template, answer lengths in
tokens + EOS, capped at --new-tokens; prompts over --max-length - --new-tokens skipped); the real policy code
plans every launch (refill, then --check-every decode steps, finished rows freed at the collect). Time model
(flags; defaults from the session-7 H200 run, BENCHMARKS.md): a decode step --step-ms at the full batch; a
prefill call --call-ms (graph replay) + --token-us per padded token, an eager one (a shape's first call, or
all with --eager) --eager-ms, the --capture-at'th call of a shape --capture-ms more (the capture; its
warm-up was the shape's first, eager call). Prints one row per (min_free, lookahead, rows_per_octave,
round_rows, reuse_ratio): modelled seconds (and the prefill's share), tok/s, the ratio to the bare loop (batch x
steps at --step-ms), occupancy, prefill calls, graphs, padded and real prefill tokens.

    python bench/regen_refill_sim.py --batch 1024 --min-free 1,8,32,64,128 --lookahead 0,256,1024
    # the prefill-shape rules against session 8's H200 figures (BENCHMARKS.md, "Prefill shapes, modelled"):
    python bench/regen_refill_sim.py --min-free 32 --lookahead 1024 --step-ms 9.29 --calibrate-prefill-s 3.44 \
        --rows-per-octave 1,2,4 --round-rows 0,1 --reuse-ratio 4,2,1.5,1
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.eval.regen_refill import RefillPolicy, plan_refill  # noqa: E402
from dflash_pipe.target.prefill_shapes import PrefillShapes  # noqa: E402

SEED = Path(__file__).resolve().parent / "data" / "smollm2_regenerated_sharegpt.jsonl.gz"


def workload(args) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens incl. EOS) of the seed's conversations that fit."""
    from dflash_pipe.eval.runner import encode_prompts
    from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_tokenizer_dir(Path(args.model_cache).expanduser())),
                                        local_files_only=True)
    rows = [json.loads(line) for line in gzip.open(SEED, "rt")][:args.prompts]
    prompts = encode_prompts(tok, [[m for m in r["messages"] if m["role"] != "assistant"][:1] for r in rows])
    answers = tok([next(m["content"] for m in r["messages"] if m["role"] == "assistant") for r in rows],
                  add_special_tokens=False)["input_ids"]
    return [(len(p), min(len(a) + 1, args.new_tokens)) for p, a in zip(prompts, answers)
            if len(p) + args.new_tokens <= args.max_length]


def simulate(work, B: int, pol: RefillPolicy, reuse: float, args) -> dict:
    ready = list(range(len(work)))          # indices into work, oldest first (the driver keeps ~B of them)
    slots = [None] * B                      # per slot: [index, tokens generated]
    t = steps = live_steps = calls = real = padded = prefill_t = 0.0
    shapes = PrefillShapes(pol.min_rows, args.max_length, reuse, pol.rows_per_octave)
    uses = shapes.uses
    while ready or any(s is not None for s in slots):
        free = [i for i, s in enumerate(slots) if s is None]
        window = [work[j][0] for j in ready[:max(len(free), pol.lookahead)]]
        plan = plan_refill(len(free), window, len(ready), B - len(free), pol)
        taken = set()
        for call in plan:
            lens = [window[i] for i in call]
            rb, tb = shapes.choose(len(call), max(lens))
            n = shapes.use((rb, tb))
            t0 = t
            if args.eager or n < args.capture_at:
                t += args.eager_ms / 1e3
            else:
                t += (args.call_ms + args.capture_ms * (n == args.capture_at)) / 1e3
            t += args.token_us * rb * tb / 1e6
            prefill_t += t - t0
            calls += 1
            real += sum(lens)
            padded += rb * tb
            for i in call:
                slot = free.pop(0)
                slots[slot] = [ready[i], 1]     # the prefill chose the first token
                taken.add(i)
        ready = [j for i, j in enumerate(ready) if i not in taken]
        for _ in range(args.check_every):
            if not any(s is not None for s in slots):
                break
            steps += 1
            t += args.step_ms / 1e3
            for s in slots:
                if s is not None and s[1] < work[s[0]][1]:
                    s[1] += 1
                    live_steps += 1
        for i, s in enumerate(slots):           # the collect
            if s is not None and s[1] >= work[s[0]][1]:
                slots[i] = None
    tokens = sum(a for _, a in work)
    bare = B * 1e3 / args.step_ms
    return {"s": round(t, 2), "tok_s": round(tokens / t), "ratio_to_bare": round(tokens / t / bare, 3),
            "occupancy": round(live_steps / (steps * B), 3), "decode_steps": int(steps), "prefill_calls": int(calls),
            "graphs": 0 if args.eager else sum(1 for n in uses.values() if n >= args.capture_at), "shapes": len(uses),
            "pad_share": round(1 - real / padded, 3), "prefill_s": round(prefill_t, 3),
            "padded_tokens": int(padded), "real_tokens": int(real),
            "uses": {f"{rb}x{tb}": n for (rb, tb), n in sorted(uses.items())} if args.uses else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--min-free", default="1,8,32,64,128")
    ap.add_argument("--lookahead", default="0,256,1024", help="0 = only as many as the free slots")
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=9.73)
    ap.add_argument("--call-ms", type=float, default=1.0)
    ap.add_argument("--token-us", type=float, default=0.7)
    ap.add_argument("--eager-ms", type=float, default=57.0)
    ap.add_argument("--capture-at", type=int, default=2, help="a shape's call that captures its graph")
    ap.add_argument("--capture-ms", type=float, default=57.0, help="host time of a capture (~ an eager call)")
    ap.add_argument("--reuse-ratio", default="2", help="engine prefill_reuse_ratio (1 = off); a list is a grid")
    ap.add_argument("--rows-per-octave", default="1", help="engine prefill_rows_per_octave (1 = rows to powers "
                                                          "of two); a list is a grid")
    ap.add_argument("--round-rows", default="1", help="RefillPolicy.round_rows (0/1, CUDA default 1); a list is a grid")
    ap.add_argument("--eager", action="store_true", help="every prefill call eager (the old path)")
    ap.add_argument("--calibrate-prefill-s", type=float, default=0.0,
                    help="set --token-us so that the session-8 rules (refill at B/32, lookahead max(256, B), rows "
                         "to powers of two, reuse within 4x) model this many prefill seconds (device timeline)")
    ap.add_argument("--uses", action="store_true", help="print the calls per padded shape")
    ap.add_argument("--model-cache", default="~/.cache/dflash-pipe/models")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = workload(args)
    print(f"{len(work)} prompts, mean {sum(p for p, _ in work) / len(work):.1f} prompt tokens, "
          f"{sum(a for _, a in work):,} answer tokens (mean {sum(a for _, a in work) / len(work):.1f})", flush=True)
    if args.calibrate_prefill_s:
        base = RefillPolicy(min_free=max(1, args.batch // 32), lookahead=max(256, args.batch), budget=args.budget,
                            max_len=args.max_length, rows_per_octave=1, round_rows=False)  # session 8's rules
        fixed = simulate(work, args.batch, base, 4.0, argparse.Namespace(**{**vars(args), "token_us": 0.0}))
        args.token_us = (args.calibrate_prefill_s - fixed["prefill_s"]) * 1e6 / fixed["padded_tokens"]
        print(f"calibrated: {args.token_us:.3f} us per padded token ({args.calibrate_prefill_s} s of prefill = "
              f"{fixed['prefill_s']} s of calls and captures + {fixed['padded_tokens']:,} padded tokens)", flush=True)
    rows = []
    grid = itertools.product(map(int, args.min_free.split(",")), map(int, args.lookahead.split(",")),
                             map(int, args.rows_per_octave.split(",")), map(int, args.round_rows.split(",")),
                             map(float, args.reuse_ratio.split(",")))
    for mf, la, octave, rnd, reuse in grid:
        pol = RefillPolicy(min_free=mf, lookahead=la, budget=args.budget, max_len=args.max_length,
                           rows_per_octave=octave, round_rows=bool(rnd))
        r = {"batch": args.batch, "min_free": mf, "lookahead": la, "rows_per_octave": octave, "round_rows": rnd,
             "reuse_ratio": reuse,
             **simulate(work, args.batch, pol, reuse, args)}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
