"""Device time of regenerate's prefills, padded against chunked (issue 18), on the prompts' real lengths.

The session-25 H100 run spent 4.0 s of its 17.7 s in prefills (271 calls, 926 k prompt tokens, 44 % of the computed
tokens padding) against 11.9 s of decode steps. This replays that workload's prefills alone: the SmolLM2 chat
prompts of the first 16,384 ShareGPT first turns (bench/data/sharegpt_first_turn_prompt_lengths.json, the token
counts `regenerate` prefills; those over max_len - new tokens are skipped as regenerate skips them), taken
`--free` at a time as a refill of that many free slots takes them (regen_refill.plan_refill with the CUDA
policy: padded calls group by length bucket within the lookahead, chunked calls take the oldest in order), into
reset rows of a `--batch`-row engine (bucketed prefill, CUDA graphs), with random weights in SmolLM2-135M's
shape (no carry needed). For each layout, in the same process: one untimed pass (warm-ups and graph captures),
then `--passes` timed passes; device seconds per pass (CUDA events), calls, real and computed tokens, prompt
tokens per second of device time.

    python bench/prefill_layouts.py --json out.json                 # GPU (bf16)
    python bench/prefill_layouts.py --smoke                         # CPU: tiny model, 200 prompts, eager
    python bench/prefill_layouts.py --make-lengths                  # CPU: rewrite the lengths file (tokenizer)
    python bench/prefill_layouts.py --plan-only --free 32,51,100    # CPU: calls and padding only, no model (the
                                                                    # CUDA refill rules, chunk buckets, graphs)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_step_profile import build_model  # noqa: E402
from dflash_pipe.eval.regen_refill import RefillPolicy, plan_refill  # noqa: E402
from dflash_pipe.target.static_forward import StaticKVEngine  # noqa: E402

LENGTHS = Path(__file__).resolve().parent / "data" / "sharegpt_first_turn_prompt_lengths.json"


def make_lengths(n: int) -> list[int]:
    """Token counts of SmolLM2-Instruct's chat prompts of the first `n` ShareGPT first user turns."""
    from dflash_pipe.data import load_conversations
    from dflash_pipe.eval.runner import encode_prompts
    from dflash_pipe.target import load_target

    tok = load_target("embedded:smollm2-135m-instruct", device="cpu", dtype="float32").tokenizer
    firsts = []
    for conv in load_conversations("embedded:sharegpt"):
        users = [m for m in conv.messages if m["role"] == "user"]
        if users:
            firsts.append([users[0]])
        if len(firsts) == n:
            break
    failed: dict[int, str] = {}
    return [len(ids) for ids in encode_prompts(tok, firsts, failed) if ids is not None]


def calls_of(lengths: list[int], free: int, policy: RefillPolicy, batch: int) -> list[list[int]]:
    """The prompts (indices) of each prefill call when `free` slots open at a time, as regenerate plans them."""
    ready = list(range(len(lengths)))
    calls = []
    while ready:
        n = min(free, len(ready))
        window = [lengths[i] for i in ready[:max(n, policy.lookahead)]]
        plan = plan_refill(n, window, len(ready), batch - n, policy)
        taken = set()
        for call in plan:
            calls.append([ready[i] for i in call])
            taken.update(call)
        ready = [r for i, r in enumerate(ready) if i not in taken]
    return calls


def plan_only(lengths: list[int], frees: list[int], batch: int, max_len: int) -> None:
    """Each layout's calls, padding and shapes (graphs) for each refill size, as CUDA would pad them; no model."""
    from dflash_pipe.target.chunked_prefill import CHUNK, chunk_bucket, chunk_count
    from dflash_pipe.target.prefill_shapes import PrefillShapes

    real = sum(lengths)
    for free in frees:
        for chunked in (False, True):
            calls = calls_of(lengths, free, RefillPolicy.for_batch(batch, True, max_len, chunked=chunked), batch)
            shapes = PrefillShapes(8, max_len, 2.0)     # the padded engine's shape choice (reuse ratio 2 on CUDA)
            computed = 0
            for call in calls:
                if chunked:
                    shape = (chunk_bucket(sum(chunk_count(lengths[i]) for i in call)), CHUNK)
                else:
                    shape = shapes.choose(len(call), max(lengths[i] for i in call))
                shapes.use(shape)
                computed += shape[0] * shape[1]
            print(f"PLAN free {free}, {'chunks' if chunked else 'padded'}: {len(calls)} calls, {real:,} prompt tokens, "
                  f"{computed:,} computed, padding {1 - real / computed:.3f}, {len(shapes.uses)} shapes", flush=True)


def one_pass(eng: StaticKVEngine, prompts: list[list[int]], calls: list[list[int]]) -> float:
    """Device seconds of every call (rows reset before each, as regenerate resets a row before refilling it)."""
    cuda = eng.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for call in calls:
        rows = list(range(len(call)))
        eng.reset(rows)
        eng.prefill([prompts[i] for i in call], rows)
    if cuda:
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3
    return time.perf_counter() - t0


def measure(model, prompts: list[list[int]], args, layout: str) -> dict:
    cuda = args.device == "cuda"
    eng = StaticKVEngine(model, args.batch, args.max_len, bucketed_prefill=True, prefill_min_rows=8 if cuda else 1,
                         prefill_layout=layout, use_graphs="auto")
    policy = RefillPolicy.for_batch(args.batch, cuda, args.max_len, chunked=eng.prefill_layout == "chunks",
                                    min_rows=eng.prefill_min_rows)
    lengths = [len(p) for p in prompts]
    calls = calls_of(lengths, args.free, policy, args.batch)
    computed = 0
    for call in calls:                           # the untimed pass: warm-ups, graph captures; counts the padding
        rows = list(range(len(call)))
        eng.reset(rows)
        eng.prefill([prompts[i] for i in call], rows)
        rb, tb = eng.last_prefill_shape
        computed += rb * tb
    secs = sorted(one_pass(eng, prompts, calls) for _ in range(args.passes))
    real = sum(lengths)
    res = {"layout": eng.prefill_layout, "calls": len(calls), "prompts": len(prompts), "real_tokens": real,
           "computed_tokens": computed, "pad_share": round(1 - real / computed, 3),
           "graphs": eng.prefill_graph_count, "device_s": [round(s, 4) for s in secs],
           "median_s": round(secs[len(secs) // 2], 4),
           "prompt_tok_s": round(real / secs[len(secs) // 2], 1)}
    print(f"SUMMARY {layout}: {res['median_s']} s of device time for {len(calls)} calls, {real:,} prompt tokens "
          f"({computed:,} computed, padding {res['pad_share']}), {res['prompt_tok_s']:,.0f} prompt tok/s, "
          f"{res['graphs']} graphs", flush=True)
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1024, help="engine rows (regenerate's batch)")
    ap.add_argument("--max-len", type=int, default=512, help="the engine's max_len (prompt + new tokens)")
    ap.add_argument("--new-tokens", type=int, default=256, help="prompts longer than max_len - this are skipped")
    ap.add_argument("--free", default="51", help="slots a refill fills (session 25: 13,829 prompts / 271 "
                                                         "calls); a comma list with --plan-only")
    ap.add_argument("--plan-only", action="store_true", help="print each layout's calls and padding, run no model")
    ap.add_argument("--layouts", default="padded,chunks")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=0, help="the first N prompts (0 = all in the lengths file)")
    ap.add_argument("--make-lengths", action="store_true", help="rewrite the lengths file from the tokenizer")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 200 prompts, one timed pass")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.make_lengths:
        lengths = make_lengths(16384)
        LENGTHS.write_text(json.dumps(lengths, separators=(",", ":")) + "\n")
        print(f"{LENGTHS}: {len(lengths)} prompts, {sum(lengths):,} tokens")
        return
    if args.smoke:
        args.device, args.dtype, args.batch, args.passes, args.prompts = "cpu", "float32", 64, 1, 200
    lengths = [n for n in json.loads(LENGTHS.read_text()) if n <= args.max_len - args.new_tokens]
    lengths = lengths[:args.prompts] if args.prompts else lengths
    if args.plan_only:
        plan_only(lengths, [int(f) for f in args.free.split(",")], args.batch, args.max_len)
        return
    args.free = int(args.free)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152 if not args.smoke else 500, (n,), generator=g).tolist() for n in lengths]
    model = build_model(torch.device(args.device), getattr(torch, args.dtype), args.smoke)
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": args.dtype, "batch": args.batch, "free": args.free, "prompts": len(prompts),
           "runs": [measure(model, prompts, args, layout) for layout in args.layouts.split(",")]}
    if len(res["runs"]) == 2:
        a, b = res["runs"]
        res["speedup"] = round(a["median_s"] / b["median_s"], 3)
        print(f"SUMMARY {b['layout']} / {a['layout']}: {res['speedup']}x less device time", flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
