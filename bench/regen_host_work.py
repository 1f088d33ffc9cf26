"""The host's share of `dflash-pipe regenerate`: its driver loop with the device taken out.

`run_regenerate` runs as the command does (real SmolLM2 tokenizer and chat template, the ShareGPT first turns,
in-order writing with fsync), but its backend is a stand-in that answers without a model: each request's answer
is a real assistant reply of the data re-tokenized and cut to --new-tokens, finished after as many 8-step
launches as its tokens need, so the answers per launch and their lengths look like a real run's. What is left
is host work: the split's tokenize / detokenize / write seconds per launch are what the real run's device must
cover while the host does them (issue 18: at SmolLM2's size a launch's device work is ~30 ms on an H100).

    python bench/regen_host_work.py --prompts 4096 --no-prefetch [--one-by-one] --json host.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_pipe.config import RunConfig  # noqa: E402
from dflash_pipe.data.sources import load_conversations  # noqa: E402
from dflash_pipe.eval import regen_turns, regenerate  # noqa: E402
from dflash_pipe.eval.regen_requests import Completion  # noqa: E402
from dflash_pipe.target.loading import load_target  # noqa: E402


class StandInBackend:
    """Answers without a device: request i gets the i-th real reply's tokens (cut to max_new), done after
    ceil(len / steps) launches (module docstring)."""

    name = "host-only stand-in"

    def __init__(self, batch: int, replies: list[list[int]], eos: int, max_new: int, steps: int = 8):
        self.B, self.replies, self.eos, self.max_new, self.steps = batch, replies, eos, max_new, steps
        self.slots: list[tuple | None] = [None] * batch       # (request, answer, launches left)
        self.n = 0
        self.describe = f"{self.name} (batch {batch}, {steps} steps a launch)"

    def busy(self) -> bool:
        return any(s is not None for s in self.slots)

    def launch(self, ready) -> None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        take = ready[:len(free)]
        del ready[:len(take)]
        for i, req in zip(free, take):
            toks = self.replies[self.n % len(self.replies)][:self.max_new]
            self.n += 1
            ended = len(toks) < self.max_new
            self.slots[i] = (req, toks, ended, -(-len(toks) // self.steps))

    def collect(self) -> list[Completion]:
        out = []
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            req, toks, ended, left = s
            if left <= 1:
                out.append(Completion(req, toks, ended, self.eos if ended else None))
                self.slots[i] = None
            else:
                self.slots[i] = (req, toks, ended, left - 1)
        return out

    def take_back(self):
        return []

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"decode_steps": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="embedded:sharegpt")
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--no-prefetch", action="store_true", help="first prompts tokenized in the loop (no worker)")
    ap.add_argument("--one-by-one", action="store_true",
                    help="detokenize answer by answer (tokenizer.decode), as regenerate did before session 32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bundle = load_target(args.model, device="cpu")
    if args.one_by_one:
        regen_turns.Regenerator.decode_texts = lambda self, seqs: [self.tokenizer.decode(q, skip_special_tokens=True)
                                                                   for q in seqs]
    tok = bundle.tokenizer
    replies = [tok.encode(m["content"], add_special_tokens=False)
               for conv in load_conversations(args.data, max_samples=2000)
               for m in conv.messages if m["role"] == "assistant" and m["content"].strip()][:4000]
    eos = int(tok.eos_token_id)
    regenerate.make_backend = lambda *a, **k: StandInBackend(args.batch, replies, eos, args.new_tokens)
    cfg = RunConfig()
    cfg.data.source, cfg.data.max_samples = args.data, args.prompts
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        state = regenerate.run_regenerate(cfg, Path(tmp) / "out.jsonl", max_new_tokens=args.new_tokens,
                                          bundle=bundle, max_turns=1, prefetch_prompts=not args.no_prefetch)
        wall = time.perf_counter() - t0
    t = state["timing"]
    launches = max(1, round(state["generated_tokens"] / (args.batch * 8 * 0.93)))   # a real run's launch count
    res = {"prefetch": not args.no_prefetch, "detokenize": "one by one" if args.one_by_one else "batch",
           "cpus": os.cpu_count(), "answers": state["rows_written"], "generated_tokens": state["generated_tokens"],
           "wall_s": round(wall, 3),
           "timing": t, "per_answer_us": {k: round(1e6 * t[k] / max(1, state["rows_written"]), 1)
                                          for k in ("tokenize_s", "detokenize_s", "write_s")},
           "per_real_launch_ms": {k: round(1e3 * t[k] / launches, 2) for k in ("tokenize_s", "detokenize_s",
                                                                                "write_s")}}
    print("SUMMARY host work per answer (us):", res["per_answer_us"], "; per launch of a real run (ms):",
          res["per_real_launch_ms"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
