"""regenerate with and without --reuse-history on the same conversations, same run: identical output, prefilled
tokens, time split (CPU by default; real SmolLM2 weights, every turn of the first N ShareGPT conversations).

    python bench/regen_reuse_cpu.py --conversations 24 --new-tokens 64 --json out.json

`--rows FILE --every N` instead counts, without a model, what reuse would prefill on an already regenerated file
(every N-th row, the chat template re-rendered turn by turn): prefilled tokens with and without it, and how many
later-turn prompts extend the previous prompt + answer (session 14's rows: `--rows
bench/data/smollm2_all_turns_greedy4.jsonl.xz --every 73`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.eval.regenerate import run_regenerate  # noqa: E402
from dflash_pipe.target import load_target  # noqa: E402

KEYS = ("prefill_rows", "prefill_calls", "prefill_tokens", "prefill_pad_share", "device_prefill_s", "device_decode_s",
        "history_reused_tokens", "history_prefills", "decode_steps", "occupancy")


def history_share(path: str, every: int, model_cache: str) -> dict:
    """Prefilled tokens of every N-th row of a regenerated file, whole histories vs what follows the previous turn."""
    import itertools
    import lzma

    from transformers import AutoTokenizer

    from dflash_pipe.eval.runner import encode_prompt
    from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_tokenizer_dir(Path(model_cache).expanduser())))
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 0, None, every)]
    full = delta = later = extends = 0
    for r in rows:
        msgs, fed = r["messages"], None
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = encode_prompt(tok, msgs[:k])
            full += len(prompt)
            if fed is not None:
                later += 1
                extends += prompt[:len(fed)] == fed
            delta += len(prompt) - (len(fed) if fed is not None and prompt[:len(fed)] == fed else 0)
            fed = prompt + tok.encode(m["content"], add_special_tokens=False)
    return {"rows": len(rows), "prefill_tokens_full": full, "prefill_tokens_reuse": delta,
            "share": round(delta / max(1, full), 3), "later_turns": later, "later_turns_extending": extends}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-cache", default="~/.cache/dflash-pipe/models")
    ap.add_argument("--work", default="/tmp/regen-reuse")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", default="", help="count on this regenerated file instead (no model; see above)")
    ap.add_argument("--every", type=int, default=73)
    args = ap.parse_args()
    if args.rows:
        print(json.dumps(history_share(args.rows, args.every, args.model_cache), indent=1))
        return
    cfg = RunConfig()
    cfg.data.source, cfg.data.max_samples, cfg.extract.max_length = "embedded:sharegpt", args.conversations, args.max_length
    bundle = load_target("embedded:smollm2-135m-instruct", device=args.device, dtype=args.dtype,
                         model_cache_dir=Path(args.model_cache).expanduser())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res, texts = {}, {}
    for reuse in (False, True):
        out = work / f"reuse{int(reuse)}.jsonl"
        out.unlink(missing_ok=True)
        Path(f"{out}.progress.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        st = run_regenerate(cfg, out, max_new_tokens=args.new_tokens, batch_size=args.batch, device=args.device,
                            bundle=bundle, max_turns=0, reuse_history=reuse)
        res["reuse" if reuse else "full_prefill"] = {"wall_s": round(time.perf_counter() - t0, 1),
                                                     "rows": st["rows_written"], "generated": st["generated_tokens"],
                                                     **{k: st["timing"].get(k) for k in KEYS}}
        texts[reuse] = out.read_text()
    res["identical_output"] = texts[False] == texts[True]
    res["speedup"] = round(res["full_prefill"]["wall_s"] / res["reuse"]["wall_s"], 3)
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
