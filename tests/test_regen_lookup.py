"""regenerate --lookup-draft K (eval/regen_lookup.py): drafts from each row's own history, verified in one forward.

The answers must be the plain decode's: checked against the same backend without drafts and against unbatched
greedy decoding, greedy and sampled, with drafts that are always right (an oracle), found by the lookup, or
always wrong. In float64: a sampled token of the tiny random model's nearly flat distribution flips on float32
rounding (a 4-token forward against a 1-token one did flip one in float32).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dflash_pipe.errors import UsageError
from dflash_pipe.eval import regen_backends
from dflash_pipe.eval.regen_lookup import LookupDrafts, draft_reference
from dflash_pipe.eval.regen_sampling import Decoding
from tests.eval_helpers import drain_backend, llama  # noqa: F401 - pytest fixture
from tests.test_eval_regenerate import _rows, cfg  # noqa: F401 - pytest fixture
from tests.test_regen_decoding import _run


@torch.inference_mode()
def test_device_drafts_equal_the_python_reference():
    """Histories over a 4-token vocabulary (many repeats) and a 50-token one (few): every row's drafts and its
    found flag equal draft_reference's, where the reference has a token (past the history: padding)."""
    g = torch.Generator().manual_seed(0)
    for vocab in (4, 50):
        lens = torch.randint(1, 40, (32,), generator=g).tolist()
        hists = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
        d = LookupDrafts(batch=32, max_len=48, k=3, device=torch.device("cpu"))
        d.hist.fill_(99)                              # stale tokens past every history
        for r, h in enumerate(hists):
            d.hist[r, :len(h)] = torch.tensor(h)
            d.hlen[r] = len(h)
        drafts, found = d.draft(32)
        for r, h in enumerate(hists):
            ref = draft_reference(h, 3)
            got = drafts[r].tolist()
            assert all(x is None or x == y for x, y in zip(ref, got)), (vocab, h, ref, got)
            matched = any(h[j:j + n] == h[-n:] for n in (1, 2, 3) if len(h) > n for j in range(len(h) - n))
            assert bool(found[r]) == matched, (h, found[r])
        assert 0 < int(found.sum()) <= 32


def _answers(llama, prompts, dec, lookup, max_new=23, batch=3, oracle=None, eos=None, shared=True):
    """Every prompt through an EngineBackend (its answers and its stats); with `oracle` (order -> answer, shift)
    the drafts are the true next tokens of each row's answer (shift 1: each true token + 1, always wrong);
    `shared`: the n-gram table shared across rows (regen_ngram_table.py)."""
    from dflash_pipe.eval import eos_token_ids

    eos = eos or eos_token_ids(llama.model, llama.tokenizer)
    be = regen_backends.EngineBackend(llama.model, eos, batch=batch, max_len=96, max_new_tokens=max_new, dec=dec,
                                      check_every=4, lookup_draft=lookup, lookup_shared=shared)
    if oracle is not None:
        truth, shift = oracle

        def draft(w):
            rows = []
            for r in range(w):
                s = be.slots[r]
                ans, n = (truth[s.order] if s is not None else []), int(be.n_gen[r])
                rows.append([(ans[i] + shift if i < len(ans) else 0) for i in range(n, n + lookup)])
            return torch.tensor(rows), torch.ones(w, dtype=torch.bool)
        be.lookup.draft = draft
    got = drain_backend(be, prompts, key_offset=500)
    return [got[i][0] + [eos[0]] * got[i][1] for i in range(len(prompts))], be.stats(), eos


def _f64(bundle):
    return dataclasses.replace(bundle, model=copy.deepcopy(bundle.model).to(torch.float64))


@pytest.fixture(scope="module")
def diverse(llama):
    """The livened tiny Llama in float64: answers that rarely repeat (drafts must come from an oracle)."""
    return _f64(llama)


@pytest.fixture(scope="module")
def repeater(tmp_path_factory):
    """The tiny random Llama as initialised (not livened), float64: greedy answers that repeat one token, as a small
    target's loops do, so the lookup finds drafts."""
    from dflash_pipe.target import load_target

    return _f64(load_target("random:tiny-llama", dtype="float32",
                            model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    loop = torch.randint(3, 49152, (5,), generator=g).tolist()
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 30, 4, 17)] + [loop * 6, loop * 2 + [7]]


@pytest.mark.parametrize("dec", [Decoding(), Decoding(temperature=1.5, greedy_after=4),
                                 Decoding(temperature=0.9, top_p=0.9)], ids=["greedy", "greedy-after", "sampled"])
def test_lookup_answers_equal_plain_decoding(repeater, prompts, dec):
    """K = 3 lookup drafts give the plain backend's answers (greedy: also unbatched greedy decoding's); where the
    answers are greedy (all or after 4 tokens) the lookup finds drafts, the target keeps them and the run takes
    fewer steps (measured: 24 against 48, 2.2 and 1.8 tokens a row-step); fully sampled answers rarely repeat."""
    from dflash_pipe.eval import greedy_generate

    plain, plain_stats, eos = _answers(repeater, prompts, dec, 0)
    spec, st, _ = _answers(repeater, prompts, dec, 3)
    assert spec == plain
    assert _answers(repeater, prompts[:2], dec, 3, batch=4)[0] == plain[:2]     # slots never filled draft nothing
    assert st["lookup_draft"] == 3 and "lookup_draft" not in plain_stats
    if dec.greedy or dec.greedy_after:
        assert st["decode_steps"] < plain_stats["decode_steps"]
        assert 1.5 < st["kept_per_row_step"] <= 4.0 and 0.5 < st["lookup_found_share"] <= 1
    else:
        assert 1.0 <= st["kept_per_row_step"] and st["decode_steps"] <= plain_stats["decode_steps"]
    if dec.greedy:
        assert all(a == greedy_generate(repeater.model, p, 23, eos) for p, a in zip(prompts, spec))


@pytest.mark.parametrize("shift,max_new", [(0, 23), (0, 8), (1, 23)], ids=["right", "right-short", "wrong"])
def test_drafts_that_are_always_right_or_always_wrong_give_the_same_answers(diverse, prompts, shift, max_new):
    """An oracle's drafts are all kept (4 tokens a step until an answer ends; max_new 8 cuts a step's 4 at the
    limit), wrong ones never (1 token a step, as a plain step); the answers stay the plain ones."""
    dec = Decoding(temperature=1.5, greedy_after=2)
    plain, plain_stats, _ = _answers(diverse, prompts, dec, 0, max_new=max_new)
    spec, st, _ = _answers(diverse, prompts, dec, 3, max_new=max_new, oracle=(plain, shift))
    assert spec == plain
    if shift:
        assert st["kept_per_row_step"] == 1.0
    else:                               # the first token comes from the prefill, then 4 a step until the end
        after_first = [len(a) - 1 for a in plain]
        assert st["kept_per_row_step"] == round(sum(after_first) / sum(-(-n // 4) for n in after_first), 3)


def test_an_eos_inside_a_kept_block_ends_the_answer_there(diverse, prompts):
    """EOS set to a token inside the first answer (its 7th): the plain answer stops at it; an oracle drafting the
    answer as it was without that EOS offers tokens past it, and the speculative answer stops at it too."""
    dec = Decoding(temperature=1.5, greedy_after=2)
    free, _, _ = _answers(diverse, prompts, dec, 0)
    stop = free[0][6]
    plain, _, _ = _answers(diverse, prompts, dec, 0, eos=[stop])
    spec, st, _ = _answers(diverse, prompts, dec, 3, eos=[stop], oracle=(free, 0))
    assert spec == plain and plain[0] == free[0][:7]
    assert st["kept_per_row_step"] > 2.0


def test_regenerate_with_lookup_drafts_writes_the_plain_rows(cfg, llama, tmp_path, capsys):
    """The CLI path end to end: the same rows as without drafts, the decode path names the drafts, the sidecar's
    timing carries the kept tokens per step."""
    plain = _run(cfg, llama, tmp_path / "plain.jsonl", engine="static")
    spec = _run(cfg, llama, tmp_path / "spec.jsonl", engine="static", lookup_draft=2)
    assert "2 lookup drafts a step" in capsys.readouterr().out
    assert (tmp_path / "spec.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    assert len(_rows(tmp_path / "spec.jsonl")) > 0
    assert spec["timing"]["kept_per_row_step"] >= 1.0 and "kept_per_row_step" not in plain["timing"]


@pytest.mark.parametrize("kw,flag", [({"lookup_draft": -1}, "--lookup-draft"), ({"lookup_draft": 16}, "--lookup-draft"),
                                     ({"lookup_draft": 2, "overlap": True}, "--overlap-prefill"),
                                     ({"lookup_draft": 2, "compact": True}, "--compact-tail")])
def test_bad_lookup_flags_are_usage_errors_naming_the_flag(cfg, llama, tmp_path, kw, flag):
    with pytest.raises(UsageError, match=flag):
        _run(cfg, llama, tmp_path / "o.jsonl", engine="static", **kw)
    assert not list(tmp_path.glob("o.jsonl*"))           # refused before the sidecar or any row is written


def test_auto_lookup_drafts_two_only_for_greedy_answers_on_cuda_graphs(cfg, llama, tmp_path, capsys):
    """--lookup-draft auto (None, the CLI's -1): 2 where it was measured to pay (greedy, CUDA graphs, no overlap /
    compaction), else off; an explicit K is kept. On the CPU the run is the plain one."""
    from dflash_pipe.eval.regen_lookup import auto_lookup

    greedy, sampled = Decoding(), Decoding(temperature=0.7)
    assert auto_lookup(None, True, greedy, False, False) == 2
    assert [auto_lookup(None, *a) for a in ((False, greedy, False, False), (True, sampled, False, False),
                                            (True, greedy, True, False), (True, greedy, False, True))] == [0] * 4
    assert auto_lookup(3, False, sampled, False, False) == 3 and auto_lookup(0, True, greedy, False, False) == 0
    st = _run(cfg, llama, tmp_path / "auto.jsonl", engine="static")
    assert "lookup drafts" not in capsys.readouterr().out and "kept_per_row_step" not in st["timing"]


def test_the_simulation_bench_counts_kept_tokens_as_worked_out_by_hand():
    """bench/lookup_sim.py on prompt [1, 2, 3], answer [1, 2, 3, 1, 2, 3, 9]: the answer's 1 comes from the prefill;
    step 1 drafts [2, 3] after the earlier 1 (both kept + the 1 chosen after them), step 2 drafts [2, 3] after the
    earlier (2, 3, 1) and keeps them with the 9: 6 tokens in 2 steps. Drafts that never match: 1 a step."""
    from bench.lookup_sim import kept_per_step

    assert kept_per_step([([1, 2, 3], [1, 2, 3, 1, 2, 3, 9])], 2, (3, 2, 1)) == 3.0
    assert kept_per_step([([5], [6, 7, 8, 9])], 2, (3, 2, 1)) == 1.0
    # --shared: the repeat of an answer drafts (5, 6) -> [7, 8] from the first (3 tokens), then nothing is
    # recorded after 9 yet (its K = 2 followers never came): 4 + 2 steps for 8 tokens, not 8
    twice = [([5], [6, 7, 8, 9, 10])] * 2
    assert kept_per_step(twice, 2, (3, 2, 1)) == 1.0 and kept_per_step(twice, 2, (3, 2, 1), shared=True) == 8 / 6


@torch.inference_mode()
@pytest.mark.parametrize("layout", ["chunks", "padded"])
def test_histories_filled_from_the_prefills_upload_equal_the_prompts(llama, layout):
    """LookupDrafts.fill from the prefill's own upload (engine.last_uploaded: 16-token chunks, or padded prompts
    with padding rows in the scratch row) writes each row's history and length exactly as the host copy of the
    prompts does; rows outside the call keep theirs."""
    from dflash_pipe.target.static_forward import StaticKVEngine

    eng = StaticKVEngine(llama.model, max_batch=6, max_len=80, kv_bucket=8, bucketed_prefill=True,
                         prefill_layout=layout)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 33, 16, 17, 1)]
    rows = [4, 0, 2, 5, 1]
    eng.prefill(prompts, rows)
    width = eng.last_uploaded.ids.shape[1]          # a chunk, or the padded length bucket
    assert width == 16 if layout == "chunks" else width >= 33
    first, rows_t = torch.tensor([7, 8, 9, 10, 11]), torch.tensor(rows)
    a, b = (LookupDrafts(batch=6, max_len=80, k=2, device=torch.device("cpu")) for _ in range(2))
    for d in (a, b):
        d.hist[3, :4] = torch.tensor([1, 2, 3, 4])
        d.hlen[3] = 4
    a.fill(rows_t, prompts, first, eng.last_uploaded)
    b.fill(rows_t, prompts, first)
    assert a.hlen.tolist() == b.hlen.tolist() == [34, 2, 17, 4, 6, 18]
    for r in range(6):
        n = int(a.hlen[r])
        assert a.hist[r, :n].tolist() == b.hist[r, :n].tolist(), r
