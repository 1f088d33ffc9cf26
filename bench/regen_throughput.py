"""Generated tokens per second of `dflash-pipe regenerate` against a bare decode loop and HF `generate`.

Three measurements, same target, same prompts (ShareGPT first turns), same --new-tokens:
  regen   `run_regenerate` (the command's code path: tokenizing, continuous batching on the static-KV
          engine, CUDA graphs, EOS checks, in-order writing with fsync) at each --batch (0 = auto), on
          --prompts prompts, first turn only. Wall time from the call to its return; generated tokens from
          the sidecar. A short untimed run first loads the kernels.
  bare    the engine's graphed decode step in a plain loop at the same batch: prefill the first `batch`
          prompts, then --new-tokens greedy steps with no stopping and no scheduling (tokens = batch x
          steps), CUDA events around the loop only.
  hf      `run_regenerate --engine hf` (left-padded HF generate, dynamic cache) on the first --hf-prompts
          prompts at --hf-batch, the old path, as a baseline.
--max-turns / --samples / --temperature / --top-p / --greedy-after set regen's decoding (e.g. issue 19's
workload: every turn, 4 samples, on the all-turns prompt file at --max-length 1280); the bare loop stays greedy.
--reuse-history-ab times regen a second time on the same prompts with --reuse-history flipped (`reuse_ab`: both
rates, their ratio, the prefilled tokens, identical rows), the A/B that issue 18's history reuse still lacks
(CPU smoke, random tiny-llama, every turn: 1.21x, prefilled tokens 1,618 vs 4,428, rows identical 10/10):
    python bench/regen_throughput.py --data /tmp/quality/carry/data/sharegpt_all_turns.jsonl --max-turns 0 \
        --samples 4 --temperature 1.0 --top-p 0.95 --greedy-after 4 --max-length 1280 --prompts 4000 \
        --batch 1024 --hf-prompts 0 --reuse-history --reuse-history-ab --json ab.json          # H200
--overlap off,off+noprefetch times regen with and without its first prompts tokenized ahead on a worker thread
(regen_turns.PromptReadAhead, the default) on the same prompts, with the rows compared (`overlap_ab`: identical by
design, the schedule does not depend on the host's timing).
--overlap off,off+padded times regen with the chunked prefill (16-token chunks, CUDA's default) and the padded one
(--prefill-layout padded) on the same prompts, with the rows compared (bf16: the two round differently):
    python bench/regen_throughput.py --data /tmp/quality/carry/data/sharegpt_first_turns.jsonl \
        --model-cache /tmp/quality/models --prompts 16384 --batch 1024 --overlap off,off+padded --hf-prompts 0
--overlap off,on times regen in both modes (regenerate --overlap-prefill: prefills on a second CUDA stream under
the decode, answers collected a step before a launch ends; regen_staging.py; on+compact adds --compact-tail)
against the same bare loop, each with its ratios, and counts the rows identical to the direct path's (`overlap_ab`):
    python bench/regen_throughput.py --data /tmp/quality/carry/data/sharegpt_first_turns.jsonl \
        --model-cache /tmp/quality/models --prompts 16384 --batch 1024 --overlap off,on --hf-prompts 0 --json ov.json
Two ratios: `ratio_regen_to_bare` is regen / the bare loop's decode-only rate (the issue's goal >= 0.9; it
pays for prefills, EOS-idle slots until the next check, the tail where slots run empty, and host work);
`ratio_regen_to_bare_with_prefill` is regen / the bare loop's rate with its own prefill included (the engine's
prefill in regenerate's layout, 64 prompts a call, timed on a second, warm pass; before session 30 an eager
padded first pass, whose compile and first-call costs made it swing from 0.8 to 2.7 s between runs): the
ceiling for a scheduler that must prefill every prompt, if every answer ran to --new-tokens. `regen.split` says where
regenerate's wall time went (the sidecar's "timing": host time in launch / collect (the wait for the device) /
tokenize / detokenize / write, device time of prefills and decode steps, decode steps, mean live rows per step
and occupancy = live rows / batch, prefill calls, the share of padding in them, prefill and decode graphs
captured). With --batch 1024,2048 each batch gets its own regen and bare runs (`runs` in the JSON).

    python bench/regen_throughput.py --data /tmp/quality/carry/data/sharegpt_first_turns.jsonl \
        --model-cache /tmp/quality/models --batch 1024,2048 --json out.json   # H200, real SmolLM2 weights (bf16)
    python bench/regen_throughput.py --smoke                        # CPU, toy sizes, random tiny-llama
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.data import load_conversations  # noqa: E402
from dflash_pipe.eval.regen_backends import EngineBackend, auto_batch_size  # noqa: E402
from dflash_pipe.eval.regenerate import run_regenerate  # noqa: E402
from dflash_pipe.eval.runner import encode_prompt  # noqa: E402
from dflash_pipe.target import load_target  # noqa: E402
from dflash_pipe.target import fused_elementwise  # noqa: E402
from dflash_pipe.target.static_forward import StaticKVEngine  # noqa: E402


def _cfg(args, n: int, skip: int = 0) -> RunConfig:
    cfg = RunConfig()
    cfg.target.model = args.model
    cfg.data.source = args.data
    cfg.data.skip_samples = skip
    cfg.data.max_samples = n
    cfg.extract.max_length = args.max_length
    return cfg


def run_regen(args, bundle, out: Path, n: int, skip: int = 0, **kw) -> dict:
    if bundle.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if kw.get("engine") != "hf":             # the decoding under test (HF generate is greedy only)
        kw = {"max_turns": args.max_turns, "samples": args.samples, "temperature": args.temperature,
              "top_p": args.top_p, "greedy_after": args.greedy_after, "reuse_history": args.reuse_history, **kw}
    else:
        kw = {"max_turns": 1, **kw}
    state = run_regenerate(_cfg(args, n, skip), out, max_new_tokens=args.new_tokens, bundle=bundle, **kw)
    wall = time.perf_counter() - t0
    return {"conversations": state["rows_written"], "skipped": len(state["skipped"]),
            "generated_tokens": state["generated_tokens"], "truncated": state["truncated_responses"],
            "wall_s": round(wall, 3), "tok_s": round(state["generated_tokens"] / wall, 1),
            "split": state.get("timing", {})}


@torch.inference_mode()
def bare_loop(args, bundle, batch: int, attention: str = "auto") -> dict:
    """Prefill `batch` real prompts, then new_tokens graphed greedy steps (no stopping, no scheduling)."""
    tok = bundle.tokenizer
    prompts = []
    for conv in load_conversations(args.data, max_samples=4 * batch):
        first = [m for m in conv.messages if m["role"] != "assistant"][:2]
        ids = encode_prompt(tok, first)
        if len(ids) + args.new_tokens <= args.max_length:
            prompts.append(ids)
        if len(prompts) == batch:
            break
    prompts = (prompts * (batch // max(1, len(prompts)) + 1))[:batch]
    eng = StaticKVEngine(bundle.model, batch, args.max_length, attention=attention, bucketed_prefill=True,
                         prefill_min_rows=8 if bundle.device.type == "cuda" else 1)
    cuda = bundle.device.type == "cuda"
    chunk = 64

    def prefill_all() -> tuple[torch.Tensor, float]:
        """Every row's prompt through the engine's own prefill (regenerate's layout), `chunk` prompts a call."""
        eng.reset()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        firsts = [eng.prefill(prompts[s:s + chunk], range(s, min(batch, s + chunk))).argmax(-1)
                  for s in range(0, batch, chunk)]
        nxt = torch.cat(firsts)
        if cuda:
            torch.cuda.synchronize()
        return nxt, time.perf_counter() - t

    prefill_all()                            # untimed: kernels, prefill graphs
    nxt, prefill_s = prefill_all()           # timed, warm: what a scheduler's prefills of these prompts cost
    first = nxt[:, None].clone()
    cur = first
    for _ in range(args.new_tokens):         # untimed pass: captures every graph the timed loop replays
        cur = eng.forward(cur).logits[:, 0].argmax(-1, keepdim=True)
    for r in range(batch):
        eng.truncate(r, len(prompts[r]))
    cur = first
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for _ in range(args.new_tokens):
        out = eng.forward(cur)
        cur = out.logits[:, 0].argmax(-1, keepdim=True)
    if cuda:
        b.record()
        torch.cuda.synchronize()
        secs = a.elapsed_time(b) / 1e3
    else:
        secs = time.perf_counter() - t0
    verify = {T: verify_step_ms(eng, batch, T, cuda) for T in args.verify_widths}
    return {"verify_ms_per_step": verify, "batch": batch, "steps": args.new_tokens, "tokens": batch * args.new_tokens,
            "prefill_layout": eng.prefill_layout,
            "mean_prompt_tokens": round(sum(map(len, prompts)) / batch, 1),
            "graphs": eng.graph_count - eng.prefill_graph_count,
            "kv_cache_gb": round(eng.cache_bytes() / 1e9, 2), "ms_per_step": round(1e3 * secs / args.new_tokens, 3),
            "tok_s": round(batch * args.new_tokens / secs, 1), "prefill_s": round(prefill_s, 3),
            "tok_s_with_prefill": round(batch * args.new_tokens / (secs + prefill_s), 1)}


def verify_step_ms(eng, batch: int, T: int, cuda: bool, steps: int = 32) -> float:
    """ms of one graphed T-token step on every row (a --lookup-draft T - 1 verify), each row's length moved back to
    one more token after it, as a step that keeps one token does; from the lengths the bare loop left."""
    ids = torch.randint(3, 1000, (batch, T), device=eng.device)

    def run() -> None:
        for _ in range(steps):
            eng.forward(ids)
            eng.lengths[:batch] -= T - 1
    run()                                    # untimed, twice: captures the graphs (the host's length bounds
    run()                                    # grow T a step and settle at max_length)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return round(1e3 * (time.perf_counter() - t) / steps, 3)


def _split_line(t: dict) -> str:
    """The regen run's time split as one line: host phases, device time, occupancy."""
    keys = ("setup_s", "wall_s", "launch_s", "host_refill_s", "collect_s", "tokenize_s", "detokenize_s", "write_s",
            "device_prefill_s",
            "device_decode_s", "device_between_launches_s", "decode_steps", "occupancy", "mean_live_rows",
            "kept_per_row_step", "lookup_found_share", "lookup_shared_share", "idle_slot_launches",
            "in_flight_full_rounds", "prefill_calls", "prefill_pad_share", "prefill_graphs", "decode_graphs",
            "staged_rows", "staging_device_waits", "device_staged_prefill_s")
    return ", ".join(f"{k} {t[k]}" for k in keys if k in t)


def warm_then_time(args, bundle, out: Path, batch: int, attention: str, profile_to: Path | None = None,
                   **kw) -> dict:
    """An untimed warm-up regen on prompts past the timed ones (kernels, graphs), then the timed run into `out`;
    with `profile_to`, the timed run under cProfile (the main thread: the host's critical path; it slows Python,
    so its rate is not comparable), the functions by own time and the backend's launch by callee written there."""
    run_regen(args, bundle, out.with_name(f"warm-{out.name}"), min(args.prompts, max(8, batch // 4)),
              skip=args.prompts, batch_size=batch, attention=attention, **kw)
    if profile_to is None:
        return run_regen(args, bundle, out, args.prompts, batch_size=batch, attention=attention, **kw)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    got = prof.runcall(run_regen, args, bundle, out, args.prompts, batch_size=batch, attention=attention, **kw)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(45)
    stats.sort_stats("cumulative").print_stats(r"dflash_pipe", 45)    # the launch path's parts, with their callees
    stats.sort_stats("cumulative").print_callees(r"_launch|_refill|_collect|chunked_prefill|_prefill\b")
    profile_to.parent.mkdir(parents=True, exist_ok=True)
    profile_to.write_text(text.getvalue())
    print(f"cProfile of the timed run: {profile_to}", flush=True)
    return got


def mode_flags(mode: str) -> dict:
    """run_regenerate's flags of an --overlap mode: off or on, with +compact (--compact-tail), +noprefetch
    (--no-prefetch-prompts: every prompt tokenized in the driver loop) and / or +padded (--prefill-layout padded:
    the padded prefill instead of the chunked one), +earlyK (--collect-early K) and / or +everyN
    (--steps-per-launch N), +lookupK (--lookup-draft K), +own (--no-lookup-shared) added (+switch, +torchops,
    +hostfill (the lookup history built from the prompt lists, as before session 34's last commits) and +profile,
    the timed run under cProfile: one_batch)."""
    base, *extra = mode.split("+")
    flags = {"overlap": base == "on", "compact": "compact" in extra, "prefetch_prompts": "noprefetch" not in extra,
             "prefill_layout": "padded" if "padded" in extra else "auto"}
    for e in extra:
        if e.startswith("early"):
            flags["collect_early"] = int(e[5:])
        elif e.startswith("every"):
            flags["steps_per_launch"] = int(e[5:])
        elif e.startswith("lookup"):
            flags["lookup_draft"] = int(e[6:])
        elif e == "own":
            flags["lookup_shared"] = False
    return flags


def regen_file(tmp: Path, batch: int, attention: str, mode: str = "off") -> Path:
    """Where the timed regen run of (batch, attention, --overlap mode) writes its rows."""
    return tmp / (f"regen{batch}-{attention}" + ("" if mode == "off" else "-" + mode.replace("+", "-")) + ".jsonl")


def reuse_ab(args, bundle, timed_out: Path, batch: int, attention: str, timed: dict, mode: str = "off") -> dict:
    """The timed regen run (its rows in `timed_out`, its --overlap `mode`) again on the same prompts with
    --reuse-history flipped (after its own warm-up): both rates, their ratio, the prefilled tokens and whether the
    rows are the same (bf16 rounding may flip some)."""
    flip = not args.reuse_history
    ab_out = timed_out.with_name(timed_out.stem + "-ab.jsonl")
    other = warm_then_time(args, bundle, ab_out, batch, attention, reuse_history=flip, **mode_flags(mode))
    on, off = (other, timed) if flip else (timed, other)
    a, b = timed_out.read_text().splitlines(), ab_out.read_text().splitlines()
    out = {"with_reuse": on, "without_reuse": off, "ratio_with_to_without": round(on["tok_s"] / off["tok_s"], 3),
           "prefill_tokens_with": on["split"].get("prefill_tokens"),
           "prefill_tokens_without": off["split"].get("prefill_tokens"),
           "rows_identical": f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"}
    print(f"SUMMARY --reuse-history A/B, batch {batch}: with {on['tok_s']:,.0f} tok/s, without {off['tok_s']:,.0f} "
          f"(ratio {out['ratio_with_to_without']}); prefilled tokens {out['prefill_tokens_with']} vs "
          f"{out['prefill_tokens_without']}; identical rows {out['rows_identical']}", flush=True)
    return out


def overlap_ab(tmp: Path, batch: int, attention: str, runs: dict) -> dict:
    """Each mode against the direct path ("off"): the rate ratio and the rows identical to it (the same answers by
    design; bf16 rounding of another prefill shape may flip a near-tie)."""
    off = runs["off"]
    a = regen_file(tmp, batch, attention).read_text().splitlines()
    out = {}
    for mode, r in runs.items():
        if mode == "off":
            continue
        b = regen_file(tmp, batch, attention, mode).read_text().splitlines()
        out[mode] = {"ratio_to_off": round(r["tok_s"] / off["tok_s"], 3),
                     "rows_identical": f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"}
        print(f"SUMMARY {mode} against off, batch {batch}, attention {attention}: {r['tok_s']:,.0f} tok/s against "
              f"{off['tok_s']:,.0f} (ratio {out[mode]['ratio_to_off']}); identical rows {out[mode]['rows_identical']}",
              flush=True)
    return out


def one_batch(args, bundle, tmp: Path, batch_arg: int, attention: str) -> dict:
    """regen (after an untimed warm-up run; each --overlap mode) and the bare loop at one batch and engine
    attention; ratios; one SUMMARY line per mode."""
    batch = batch_arg or auto_batch_size(bundle.model, args.max_length)
    modes = args.overlap.split(",")
    res = {"batch": batch, "attention": attention, "regen_by_overlap": {}}
    switch = sys.getswitchinterval()
    for mode in modes:
        fused_elementwise.ENABLED = "torchops" not in mode.split("+")    # +torchops: PyTorch's RoPE / SwiGLU ops
        EngineBackend.FILL_FROM_UPLOAD = "hostfill" not in mode.split("+")   # +hostfill: lookup history from lists
        sys.setswitchinterval(2e-4 if "switch" in mode.split("+") else switch)  # +switch: the GIL handed over sooner
        prof = ((args.json or Path("regen_throughput.json")).with_name(f"cprofile-{mode.replace('+', '-')}.txt")
                if "profile" in mode.split("+") else None)
        res["regen_by_overlap"][mode] = warm_then_time(args, bundle, regen_file(tmp, batch, attention, mode), batch,
                                                       attention, profile_to=prof, **mode_flags(mode))
        print(f"regen (overlap {mode})", res["regen_by_overlap"][mode], flush=True)
    fused_elementwise.ENABLED = True
    EngineBackend.FILL_FROM_UPLOAD = True
    sys.setswitchinterval(switch)
    res["regen"] = res["regen_by_overlap"][modes[0]]
    res["bare"] = bare_loop(args, bundle, batch, attention)
    print("bare", res["bare"], flush=True)
    if args.reuse_history_ab:
        res["reuse_ab"] = reuse_ab(args, bundle, regen_file(tmp, batch, attention, modes[0]), batch, attention,
                                   res["regen"], modes[0])
    if "off" in modes and len(modes) > 1:
        res["overlap_ab"] = overlap_ab(tmp, batch, attention, res["regen_by_overlap"])
    for mode in modes:
        _summary(res, res["regen_by_overlap"][mode], mode, batch, attention)
    return res


def _summary(res: dict, regen: dict, mode: str, batch: int, attention: str) -> None:
    """The ratios of one regen run to the bare loop (kept in `regen`, and at the top of `res` for the first mode)."""
    regen["ratio_regen_to_bare"] = round(regen["tok_s"] / res["bare"]["tok_s"], 3)
    regen["ratio_regen_to_bare_with_prefill"] = round(regen["tok_s"] / res["bare"]["tok_s_with_prefill"], 3)
    if regen is res["regen"]:
        res["ratio_regen_to_bare"] = regen["ratio_regen_to_bare"]
        res["ratio_regen_to_bare_with_prefill"] = regen["ratio_regen_to_bare_with_prefill"]
    print(f"SUMMARY batch {batch}, attention {attention}, overlap {mode}: regenerate {regen['tok_s']:,.0f} tok/s "
          f"({regen['conversations']} answers, {regen['generated_tokens']:,} tokens in {regen['wall_s']} s), bare loop "
          f"{res['bare']['tok_s']:,.0f} tok/s ({res['bare']['ms_per_step']} ms/step; "
          f"{res['bare']['tok_s_with_prefill']:,.0f} with its prefill), ratio {regen['ratio_regen_to_bare']} "
          f"to the decode loop (goal >= 0.9), {regen['ratio_regen_to_bare_with_prefill']} to the loop with its "
          f"prefill (the ceiling of a scheduler that must prefill); regen split: {_split_line(regen.get('split', {}))}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--model-cache", default="~/.cache/dflash-pipe/models")
    ap.add_argument("--data", default="embedded:sharegpt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8192, help="conversations for the timed regenerate run")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512,
                    help="prompt + new tokens limit, the engine's max_len (512 as in "
                         "manifests/quality-smollm2-gpu.toml; longer prompts are skipped and counted)")
    ap.add_argument("--batch", default="0", help="comma list of batches, each measured for regen and the bare "
                                                 "loop (0 = regenerate's default, auto)")
    ap.add_argument("--attention", default="auto", help="comma list of the engine's decode attention (auto, rows, "
                                                        "sdpa), each measured at every batch, in order")
    ap.add_argument("--max-turns", type=int, default=1, help="regenerate's --max-turns (0 = every turn: needs a "
                                                            "multi-turn --data and a larger --max-length)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--greedy-after", type=int, default=0)
    ap.add_argument("--reuse-history", action="store_true", help="regenerate --reuse-history (with --max-turns 0)")
    ap.add_argument("--reuse-history-ab", action="store_true",
                    help="also time regen with --reuse-history flipped on the same prompts (an A/B in one run)")
    ap.add_argument("--overlap", default="off", help="comma list of regenerate's modes, each timed at every batch "
                                                     "and attention: off, on (--overlap-prefill), and either with "
                                                     "+compact (--compact-tail), +noprefetch "
                                                     "(--no-prefetch-prompts), +padded (--prefill-layout "
                                                     "padded), +earlyK (--collect-early K), +everyN "
                                                     "(--steps-per-launch N), +switch (the GIL's switch "
                                                     "interval 0.2 ms, not 5), +torchops (the engine's "
                                                     "RoPE / SwiGLU as PyTorch ops, not fused kernels), e.g. "
                                                     "off,on,on+compact or "
                                                     "off,off+early1,off+every16")
    ap.add_argument("--profile", type=int, default=0, help="then the first N prompts through regenerate again "
                                                          "under torch.profiler at the first batch and --overlap "
                                                          "mode: device busy share, idle gaps, top ops "
                                                          "(bench/regen_profile.py; tables next to --json)")
    ap.add_argument("--verify-widths", type=lambda v: [int(x) for x in v.split(",") if x], default=[1, 3, 4],
                    help="after the bare loop, ms of a graphed step of T tokens on every row for each T here (1: the "
                         "decode step; T > 1: a --lookup-draft T - 1 verify), at the lengths the loop left")
    ap.add_argument("--hf-prompts", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="CPU, random tiny-llama, toy sizes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.smoke:
        args.model, args.device, args.dtype = "random:tiny-llama", "cpu", "float32"
        args.prompts, args.new_tokens, args.max_length, args.hf_prompts, args.hf_batch = 12, 8, 384, 4, 4
        batches = [b or 4 for b in batches]
    bundle = load_target(args.model, device=args.device, dtype=args.dtype, model_cache_dir=args.model_cache)
    res = {"model": args.model, "dtype": args.dtype, "device": args.device, "new_tokens": args.new_tokens,
           "max_length": args.max_length, "prompts": args.prompts,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res["runs"] = [one_batch(args, bundle, tmp, b, a) for b in batches for a in args.attention.split(",")]
        res.update(res["runs"][0])               # the first batch also at the top level (earlier JSON layout)
        first, first_mode = {}, args.overlap.split(",")[0]     # each run's first --overlap mode stands for it
        for r in res["runs"]:                    # the same answers whatever the attention? (bf16: rounding differs)
            lines = regen_file(tmp, r["batch"], r["attention"], first_mode).read_text().splitlines()
            ref = first.setdefault(r["batch"], lines)
            r["rows_identical_to_first_attention"] = f"{sum(x == y for x, y in zip(lines, ref))}/{len(ref)}"
        if args.profile:
            from bench.regen_profile import profile_regen
            b, a = res["runs"][0]["batch"], res["runs"][0]["attention"]
            run = lambda: run_regen(args, bundle, tmp / "profiled.jsonl", args.profile,  # noqa: E731
                                    batch_size=b, attention=a, **mode_flags(first_mode))
            tables = (args.json or Path("regen")).with_name((args.json or Path("regen")).stem + "_profile.txt")
            res["profile"] = profile_regen(run, tables)
            print("profile", json.dumps(res["profile"]), flush=True)
        if args.hf_prompts:
            res["hf"] = run_regen(args, bundle, tmp / "hf.jsonl", args.hf_prompts, batch_size=args.hf_batch,
                                  engine="hf")
            print("hf", res["hf"], flush=True)
            # identical greedy answers on the shared prompts? (bf16: batch-dependent rounding may flip a few;
            # not asked when regen sampled or answered more turns)
            a = (tmp / "hf.jsonl").read_text().splitlines()
            b = regen_file(tmp, res["batch"], res["attention"], first_mode).read_text().splitlines()[:len(a)]
            same_task = args.temperature == 0 and args.max_turns == 1
            res["hf_identical_rows"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}" if same_task else "n/a"
            print(f"SUMMARY HF generate {res['hf']['tok_s']:,.0f} tok/s at batch {args.hf_batch}, identical rows "
                  f"{res['hf_identical_rows']}", flush=True)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
