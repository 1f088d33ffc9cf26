"""Prompt-lookup drafting: the vectorised proposer vs a plain-loop reference, and through the harness."""

from __future__ import annotations

import random

import pytest

from dflash_pipe.errors import UsageError
from dflash_pipe.eval import NgramProposer, TargetVerifier, eos_token_ids, ngram_propose, speculative_generate
from dflash_pipe.eval.runner import encode_prompt
from dflash_pipe.target import load_target
from tests.eval_helpers import PROMPTS, hf_greedy, liven


def reference_propose(tokens, num, max_n, min_n):
    """Longest n first; for that n, the latest earlier start i with a token after the n-gram."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        best = None
        for i in range(0, L - n):                 # i + n <= L - 1: at least one token follows
            if tokens[i:i + n] == suffix:
                best = i
        if best is not None:
            return tokens[best + n:best + n + num]
    return []


@pytest.mark.parametrize("tokens,num,expect", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),            # trigram match at 0
    ([5, 1, 7, 5, 1, 8, 5, 1], 4, [8, 5, 1]),         # bigram [5,1] at 0 and 3: the latest (3) wins
    ([4, 4, 4, 4], 5, [4]),                           # overlapping: [4,4,4] at 0 -> tokens[3:]
    ([1, 2, 3, 4], 3, []),                            # nothing repeats
    ([7], 3, []),
    ([1, 2, 9, 9, 3, 1, 2], 2, [9, 9]),               # bigram beats the unigram [2]
    ([3, 1, 3, 2, 3], 1, [2]),                        # unigram 3 latest earlier at 2
])
def test_hand_made_sequences(tokens, num, expect):
    assert ngram_propose(tokens, num) == expect
    assert reference_propose(tokens, num, 3, 1) == expect


def test_matches_plain_loop_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(600):
        L = rng.randint(1, 40)
        tokens = [rng.randint(0, rng.choice((2, 4, 9))) for _ in range(L)]
        num = rng.randint(1, 6)
        max_n = rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        assert ngram_propose(tokens, num, max_n, min_n) == reference_propose(tokens, num, max_n, min_n), \
            (tokens, num, max_n, min_n)


def test_min_n_excludes_shorter_matches_and_bad_sizes_are_refused():
    assert ngram_propose([5, 6, 1, 5], 2, max_n=3, min_n=2) == []      # only the unigram 5 matches
    assert ngram_propose([5, 6, 1, 5], 2, max_n=3, min_n=1) == [6, 1]
    assert ngram_propose([5, 6, 5], 0) == []
    with pytest.raises(UsageError):
        ngram_propose([1, 2], 1, max_n=1, min_n=2)
    with pytest.raises(UsageError):
        NgramProposer(max_n=0)


def test_ngram_through_the_harness_is_exact_and_accepts_on_repetitive_text(tmp_path_factory):
    bundle = load_target("random:tiny-llama", dtype="float32",
                         model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache")
    liven(bundle.model, std=0.1)              # this init repeats short patterns: prompt lookup has work to do
    eos = eos_token_ids(bundle.model, bundle.tokenizer)
    verifier = TargetVerifier(bundle.model)
    accepted = 0
    for msgs in PROMPTS:
        ids = encode_prompt(bundle.tokenizer, msgs)
        ref = hf_greedy(bundle.model, ids, 40, eos)
        r = speculative_generate(verifier, NgramProposer(), ids, block_size=6, max_new_tokens=40, eos_ids=eos)
        assert r.tokens == ref
        # every step's drafts are exactly what the reference lookup proposes on the committed prefix
        committed = list(ids) + [ref[0]]
        for prop, limit, acc, c in zip(r.proposed, r.slot_limit, r.accepted, r.committed):
            want = reference_propose(committed, limit, 3, 1)
            assert prop == len(want)
            n_ok = 0
            while n_ok < len(want) and want[n_ok] == (ids + ref)[len(committed) + n_ok]:
                n_ok += 1
            assert acc == n_ok
            committed += ref[len(committed) - len(ids):len(committed) - len(ids) + c]
        accepted += sum(r.accepted)
    assert accepted > 0
