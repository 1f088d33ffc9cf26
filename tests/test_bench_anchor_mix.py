"""bench/anchor_mix.py: per-token assistant-turn index and copyable flags of real tokenized conversations, and
rows packed within the context."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.anchor_mix import load_docs, pack  # noqa: E402


def test_turns_and_copyable_positions_of_a_two_turn_conversation(tmp_path):
    answer = "The quick brown fox jumps over the lazy dog near the river bank today."
    rows = [{"messages": [{"role": "user", "content": "Tell me a sentence."}, {"role": "assistant", "content": answer},
                          {"role": "user", "content": "Say it again."}, {"role": "assistant", "content": answer}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]}]
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_docs(str(path), 1280)
    assert len(docs) == 2
    ids, mask, turn, copy = docs[0]
    sup = np.flatnonzero(mask)
    assert set(turn[sup].tolist()) == {0, 1}                      # two assistant turns, in order
    first, second = sup[turn[sup] == 0], sup[turn[sup] == 1]
    assert first.max() < second.min()
    # the repeated answer: most of the second turn is copyable, none of the first one's interior is
    assert copy[second[3:-3]].mean() > 0.8 and copy[first[3:-3]].mean() == 0.0
    assert set(docs[1][2][np.flatnonzero(docs[1][1])].tolist()) == {0}


def test_pack_fills_rows_within_the_context():
    docs = [(np.zeros(n), None, None, None) for n in (300, 500, 200, 900, 100)]
    rows = pack(docs, 1000)
    assert sorted(i for r in rows for i in r) == list(range(5))
    assert all(sum(len(docs[i][0]) for i in r) <= 1000 for r in rows)
