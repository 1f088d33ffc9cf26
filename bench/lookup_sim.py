"""How many tokens `regenerate --lookup-draft K` keeps per row-step, simulated on answers already generated.

The acceptance is exact-match, so on a greedy answer it is a function of the token sequence alone: draft from the
prompt + the answer so far (`regen_lookup.draft_reference`, the rule the device code is tested against), keep the
drafts up to the first that differs from the answer, plus one token. No model runs; the target's tokenizer
rebuilds the token sequences from a regenerated JSONL (first user turn + first answer):

    dflash-pipe regenerate -m manifests/default.toml -o /tmp/regen.jsonl --max-new-tokens 256 --max-turns 1
    python bench/lookup_sim.py --rows /tmp/regen.jsonl --k 1,2,3,4 --ngrams "3,2,1;4,3,2,1;2,1" --shared

Prints one line per (K, n-gram rule): tokens kept a row-step (the speed-up if a step cost no more than a plain one);
with --shared also with the n-gram table shared across rows (regen_ngram_table.py; the answers one after another,
each step's kept tokens recorded at once, unhashed).
Re-tokenising an answer's text may differ slightly from the tokens generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_pipe.eval.regen_lookup import draft_reference  # noqa: E402
from dflash_pipe.eval.regen_ngram_table import SharedNgramsReference  # noqa: E402


def kept_per_step(pairs: list[tuple[list[int], list[int]]], k: int, ngrams: tuple[int, ...],
                  shared: bool = False) -> float:
    """Tokens kept per row-step over (prompt, answer) pairs; the answer's first token comes from the prefill."""
    steps = tokens = 0
    table = SharedNgramsReference(k) if shared else None
    for prompt, answer in pairs:
        i = 1
        while i < len(answer):
            drafts = draft_reference(prompt + answer[:i], k, ngrams, shared=table)
            agree = 0
            while agree < k and i + agree < len(answer) and drafts[agree] == answer[i + agree]:
                agree += 1
            n = min(agree + 1, len(answer) - i)
            if table is not None:
                table.record(prompt + answer[:i + n], len(prompt) + i)
            i, steps, tokens = i + n, steps + 1, tokens + n
    return tokens / max(1, steps)


def load_pairs(rows: Path, tokenizer) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for line in rows.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        if len(msgs) < 2 or msgs[1]["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tokenizer(msgs[1]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((prompt, answer))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=Path, required=True, help="a regenerated JSONL (dflash-pipe regenerate)")
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct", help="whose tokenizer")
    ap.add_argument("--k", default="1,2,3,4", help="comma list of draft counts")
    ap.add_argument("--ngrams", default="3,2,1", help="';'-separated rules, each the n-gram lengths tried in order")
    ap.add_argument("--shared", action="store_true", help="also with the n-gram table shared across rows")
    args = ap.parse_args()
    from dflash_pipe.target import load_target

    pairs = load_pairs(args.rows, load_target(args.model, device="cpu", dtype="float32").tokenizer)
    print(f"{len(pairs)} answers, {sum(len(a) for _, a in pairs):,} tokens")
    for k in (int(x) for x in args.k.split(",")):
        for rule in args.ngrams.split(";"):
            ngrams = tuple(int(x) for x in rule.split(","))
            for shared in (False, True) if args.shared else (False,):
                print(f"K {k} n-grams {rule}{' + shared table' if shared else ''}: "
                      f"{kept_per_step(pairs, k, ngrams, shared):.3f} tokens kept a row-step", flush=True)


if __name__ == "__main__":
    main()
