"""eval/replay.py: a method's steps walked against the target-only reference equal real speculative decoding's
(accepted and committed per step, the drafts themselves, the features the proposer saw), on the HF-cache
verifier and on the static-KV engine (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval import eos_token_ids, greedy_generate
from dflash_pipe.eval.draft_graph import GraphedDFlashProposer
from dflash_pipe.eval.engine_step import EngineTarget, EngineVerifier
from dflash_pipe.eval.ngram import NgramProposer
from dflash_pipe.eval.replay import replay_generate, same_steps, teacher_forced_scan
from dflash_pipe.eval.runner import encode_prompt
from dflash_pipe.eval.specdecode import DFlashProposer, SpecResult, make_dflash_verifier, speculative_generate
from tests.eval_helpers import PROMPTS, CorruptingOracle, liven, llama, tiny_drafter  # noqa: F401 - fixture

NEW, VOCAB, B = 24, 49152, 5


class Recording:
    """Wraps a proposer and keeps every (anchor, drafts) it returned."""

    def __init__(self, inner):
        self.inner, self.needs_features, self.calls = inner, inner.needs_features, []

    def reset(self):
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def propose(self, tokens, features, num):
        drafts = list(self.inner.propose(tokens, features, num))
        self.calls.append((len(tokens) - 1, drafts))
        return drafts


def _verifiers(llama, cfg):
    target = EngineTarget(llama.model, cfg.target_layer_ids, max_len=128, limit=4096)
    return {"hf": lambda: make_dflash_verifier(llama.model, cfg, llama.num_layers, llama.hidden_size),
            "engine": lambda: EngineVerifier(target, cfg.target_layer_ids, block_size=B)}


@pytest.mark.parametrize("kind", ["hf", "engine"])
def test_replay_takes_the_decoded_steps_for_oracle_dflash_and_ngram(llama, kind):
    eos = eos_token_ids(llama.model, llama.tokenizer)
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 3, 7), seed=2)
    liven(drafter, std=0.2, seed=2)
    m = llama.model
    make = _verifiers(llama, cfg)[kind]
    for ids in [encode_prompt(llama.tokenizer, p) for p in PROMPTS[:2]]:
        ref = greedy_generate(m, ids, NEW, eos)
        proposers = {
            "oracle": lambda: CorruptingOracle(ids + ref, lambda s: (s * 3) % B, VOCAB, needs_features=True),
            "dflash": lambda: Recording(DFlashProposer(drafter, cfg, m.get_input_embeddings().weight,
                                                      m.get_output_embeddings())),
            # the eval's proposer on CUDA (fixed-shape buffers; eager here): in replay the feature rows past the
            # anchor already hold later tokens' features, which its update writes and the mask must hide
            "dflash-buffers": lambda: Recording(GraphedDFlashProposer(drafter, cfg, m.get_input_embeddings().weight,
                                                                      m.get_output_embeddings(), use_graphs="off",
                                                                      kv_bucket=8)),
            "ngram": lambda: Recording(NgramProposer()),
        }
        for name, new in proposers.items():
            runs = []
            for fn in (speculative_generate, None):
                prop = new()
                with make() as verifier:
                    if fn is None:
                        r = replay_generate(verifier, prop, ids, ref, block_size=B, max_new_tokens=NEW, eos_ids=eos)
                    else:
                        r = fn(verifier, prop, ids, block_size=B, max_new_tokens=NEW, eos_ids=eos)
                runs.append((r, prop))
            (dec, p_dec), (rep, p_rep) = runs
            assert dec.tokens == rep.tokens == ref and rep.replayed and not dec.replayed
            assert same_steps(dec, rep), (kind, name, dec.accepted, rep.accepted)
            assert dec.proposed == rep.proposed and dec.slot_limit == rep.slot_limit
            if name == "oracle":                  # drafts accepted and rejected; the features the proposer saw
                assert 0 < sum(rep.accepted) < sum(rep.proposed)
                for (tok_d, f_d), (tok_r, f_r) in zip(p_dec.seen, p_rep.seen):
                    assert tok_d == tok_r
                    rel = float((f_r.double() - f_d.double()).norm() / f_d.double().norm())
                    assert rel < 1e-5, rel    # one pass over the sequence against the prompt + verify chunks
            else:
                assert p_dec.calls == p_rep.calls                          # the same drafts at the same anchors


def test_replay_stops_at_an_eos_inside_the_reference_with_the_same_tau(llama):
    """A perfect oracle with an EOS in the middle of the reference: decoding may also accept drafts past the EOS
    (it compares them with the target's argmaxes there), replay stops at it; what is committed is the same."""
    drafter, cfg = tiny_drafter(block_size=B)
    ids = encode_prompt(llama.tokenizer, PROMPTS[0])
    full = greedy_generate(llama.model, ids, NEW, [])
    stop = [full[9]]
    ref = greedy_generate(llama.model, ids, NEW, stop)
    assert ref == full[:full.index(stop[0]) + 1]
    out = []
    for fn in (speculative_generate, None):
        oracle = CorruptingOracle(ids + full, lambda s: 99, VOCAB)      # never wrong
        with make_dflash_verifier(llama.model, cfg, llama.num_layers, llama.hidden_size) as v:
            if fn is None:
                out.append(replay_generate(v, oracle, ids, ref, block_size=B, max_new_tokens=NEW, eos_ids=stop))
            else:
                out.append(fn(v, oracle, ids, block_size=B, max_new_tokens=NEW, eos_ids=stop))
    dec, rep = out
    assert dec.tokens == rep.tokens == ref
    assert dec.committed == rep.committed and dec.tau == rep.tau
    assert rep.accepted[:-1] == dec.accepted[:-1] and rep.accepted[-1] <= dec.accepted[-1]



def _training_layout_drafts(llama, drafter, cfg, ids, ref, every):
    """Independent of replay.py: (anchor, drafts) of each block through the training forward (the whole sequence
    as context, masked at kv >= anchor; drafter/masks.py) on HF hidden states."""
    from dflash_pipe.drafter import AttentionMask, block_positions
    from dflash_pipe.target import standalone_features

    seq = ids + ref
    feats = standalone_features(llama, torch.tensor(seq), cfg.target_layer_ids).hidden_TD
    emb, head = llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings()
    T, out = len(seq), []
    ctx_pos = torch.arange(T)
    for n in range(1, len(ref), every):
        p = len(ids) + n - 1                                    # the anchor: reference token n - 1
        anchor = torch.tensor([p])
        mask = AttentionMask(torch.zeros(T, dtype=torch.int32), anchor, torch.zeros(1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.bool), cfg.block_size)
        block = torch.tensor([seq[p]] + [cfg.mask_token_id] * (cfg.block_size - 1))
        with torch.inference_mode():
            h = drafter(feats, emb[block], ctx_pos, block_positions(ctx_pos, anchor, cfg.block_size), mask)
            out.append((p, head(h[1:]).argmax(-1).tolist()[:min(cfg.block_size - 1, len(ref) - n)]))
    return out


@pytest.mark.parametrize("every", [1, 3])
def test_teacher_forced_scan_drafts_the_training_layout_blocks_and_sums_their_tau(llama, every):
    """--teacher-forced-every: the scan proposes, at every `every`-th reference token, the drafts the training
    forward gives there (both eval proposers), and sums tau = 1 + the matching prefix, checked with an oracle that
    is wrong at a known slot on each block."""
    eos = eos_token_ids(llama.model, llama.tokenizer)
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 3, 7), seed=5)
    liven(drafter, std=0.3, seed=5)
    m = llama.model
    ids = encode_prompt(llama.tokenizer, PROMPTS[1])
    ref = greedy_generate(m, ids, NEW, eos)
    want = _training_layout_drafts(llama, drafter, cfg, ids, ref, every)
    args = (drafter, cfg, m.get_input_embeddings().weight, m.get_output_embeddings())
    for prop in (DFlashProposer(*args), GraphedDFlashProposer(*args, use_graphs="off", kv_bucket=8)):
        rec = Recording(prop)
        with make_dflash_verifier(m, cfg, llama.num_layers, llama.hidden_size) as v:
            r = replay_generate(v, rec, ids, ref, block_size=B, max_new_tokens=NEW, eos_ids=eos, scan_every=every)
        assert rec.calls[-len(want):] == want                      # the scan's calls come after the walk's
        taus = [1 + next((k for k, t in enumerate(d) if t != ref[p - len(ids) + 1 + k]), len(d)) for p, d in want]
        assert r.scan_blocks == len(want) == len(range(1, len(ref), every))
        assert r.scan_tau_sum == sum(taus) and abs(r.scan_inv_tau_sum - sum(1 / t for t in taus)) < 1e-9
        assert r.scan_matched == [t - 1 for t in taus]             # per block, in anchor order
    oracle = CorruptingOracle(ids + ref, lambda s: s % B, VOCAB)    # wrong at slot 0, 1, .. B-1 (= none), ..
    res = SpecResult([], B)
    teacher_forced_scan(oracle, ids, ref, None, B, every, res)
    taus = [1 + e for e in oracle.expected]
    assert len(set(taus)) > 2 and res.scan_blocks == len(taus)
    assert res.scan_tau_sum == sum(taus) and abs(res.scan_inv_tau_sum - sum(1 / t for t in taus)) < 1e-9
    assert res.scan_matched == oracle.expected
