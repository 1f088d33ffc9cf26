"""The n-gram table regenerate's lookup drafts share across rows (eval/regen_ngram_table.py, `--lookup-shared`).

The hashed device table against the plain-Python one (same writes, same order), the drafts it changes against
`draft_reference`, and end to end: the answers stay the plain decode's while a repeated prompt's drafts come from
the table.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_lookup import LookupDrafts, draft_reference
from dflash_pipe.eval.regen_ngram_table import (MAX_N, SharedNgrams, SharedNgramsReference, prime_at_least,
                                                table_size)
from dflash_pipe.eval.regen_sampling import Decoding
from tests.eval_helpers import llama  # noqa: F401 - pytest fixture
from tests.test_regen_lookup import _answers, _f64


def test_table_sizes_are_primes_within_bounds():
    assert prime_at_least(4096) == 4099 and prime_at_least(2) == 2 and prime_at_least(13) == 13
    assert table_size(4, 64) == 4099 and table_size(1024, 600) == prime_at_least(1 << 20)


@torch.inference_mode()
@pytest.mark.parametrize("vocab,slots", [(5, 1 << 20), (40, 1 << 20), (40, 4096)])
def test_the_hashed_table_records_and_finds_what_the_python_one_does(vocab, slots):
    """Eight rows grow by 0..3 tokens a step (K = 2) over a 5-token vocabulary (n-grams recur within a step:
    the same slot written twice, the last write wins on the CPU as in the reference) and a 40-token one, into
    tables of 4,099 slots (collisions evict) and of 1 Mi. After every step each row's longest n-gram and its K
    tokens equal the reference's, hashed the same way; unhashed, with 1 Mi slots, too."""
    g = torch.Generator().manual_seed(vocab)
    k, rows, L = 2, 8, 120
    dev = SharedNgrams(k, slots, torch.device("cpu"))
    ref = SharedNgramsReference(k, dev.P)
    plain = SharedNgramsReference(k) if slots > 4096 else None
    hist = torch.zeros((rows, L), dtype=torch.long)
    hl = torch.randint(1, 6, (rows,), generator=g)
    seqs = []
    for r in range(rows):
        seqs.append(torch.randint(0, vocab, (int(hl[r]),), generator=g).tolist())
        hist[r, :hl[r]] = torch.tensor(seqs[r])
    hits = 0
    for _ in range(25):
        kept = torch.randint(0, k + 2, (rows,), generator=g)
        old = hl.clone()
        for r in range(rows):
            new = torch.randint(0, vocab, (int(kept[r]),), generator=g).tolist()
            hist[r, old[r]:old[r] + len(new)] = torch.tensor(new, dtype=torch.long)
            seqs[r] += new
        dev.record(hist, old, kept)
        for r in range(rows):
            for t in (ref, plain) if plain else (ref,):
                t.record(seqs[r], int(old[r]))
        hl = old + kept
        n, got = dev.lookup(hist, hl - 1)
        for r in range(rows):
            for t in (ref, plain) if plain else (ref,):
                rn, rgot = t.lookup(seqs[r])
                assert int(n[r]) == rn, (vocab, r, seqs[r])
                if rn:
                    assert got[r].tolist() == rgot
            hits += int(n[r]) > 0
    assert hits > 50 and len(ref.table) > 30
    assert MAX_N == 3


@torch.inference_mode()
def test_drafts_take_the_table_only_where_it_holds_a_longer_match():
    """Row 0's growth fills the table (3 tokens a step); then each row's drafts equal draft_reference(shared=the
    reference table): row 0 has no match anywhere (its last token repeated), row 1 only the table's (8, 9), row 2
    its own (8, 9) ties the table's and wins, row 3's own 1-gram (9) loses to the table's 2-gram. Without the
    table, row 1 drafts nothing."""
    k = 2
    d = LookupDrafts(batch=4, max_len=32, k=k, device=torch.device("cpu"))
    own = LookupDrafts(batch=4, max_len=32, k=k, device=torch.device("cpu"), shared=False)
    ref = SharedNgramsReference(k)
    donor = [7, 8, 9, 10, 11, 12, 7, 8, 13]
    rows = [donor, [1, 2, 8, 9], [3, 8, 9, 4, 8, 9], [9, 5, 8, 9]]
    for t in (d, own):
        for r, h in enumerate(rows):
            t.hist[r, :len(h)] = torch.tensor(h)
            t.hlen[r] = len(h)
    for old in (0, 3, 6):
        d.table.record(d.hist[:4], torch.tensor([old] + [len(h) for h in rows[1:]]), torch.tensor([3, 0, 0, 0]))
        ref.record(donor[:old + 3], old)
    drafts, source = d.draft(4)
    assert [draft_reference(h, k, shared=ref) for h in rows] == drafts.tolist()
    assert drafts.tolist() == [[13, 13], [10, 11], [4, 8], [10, 11]] and source.tolist() == [0, 2, 1, 2]
    own_drafts, own_source = own.draft(4)
    assert own_source.tolist() == [0, 0, 1, 1] and own_drafts.tolist() == [[13, 13], [9, 9], [4, 8], [5, 8]]


def test_a_repeated_prompt_drafts_from_the_first_answer_and_answers_stay_plain(llama):
    """Batch 1, greedy, the livened tiny Llama in float64 (answers that never repeat themselves here): the same
    prompt twice around another (two keys, one greedy answer). With the table the repeat's drafts come from the
    first answer and are kept; the answers equal the plain decode's with and without the table."""
    diverse = _f64(llama)
    g = torch.Generator().manual_seed(5)
    p = torch.randint(3, 49152, (12,), generator=g).tolist()
    prompts = [p, torch.randint(3, 49152, (7,), generator=g).tolist(), p]
    dec = Decoding()
    plain, _, _ = _answers(diverse, prompts, dec, 0, max_new=24, batch=1)
    shared, st, _ = _answers(diverse, prompts, dec, 2, max_new=24, batch=1)
    only_own, st_own, _ = _answers(diverse, prompts, dec, 2, max_new=24, batch=1, shared=False)
    assert shared == plain == only_own and plain[0] == plain[2]
    assert st_own["lookup_shared_share"] is None and st_own["kept_per_row_step"] == 1.0     # measured: 72 steps
    # the third answer's 23 tokens after its first: 3 a step from the table (8 steps, not 23; measured: 56 in all)
    assert st["decode_steps"] <= st_own["decode_steps"] - 14 and st["lookup_shared_share"] > 0.1
