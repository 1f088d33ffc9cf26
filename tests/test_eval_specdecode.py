"""Speculative decoding: output identical to target-only greedy, exact accept logic, exact drafter inputs.

References are independent of the harness: transformers' own `generate` for the tokens, HF
`output_hidden_states` forwards of the committed sequence for the drafter's context features,
and the training-layout drafter call (a longer context with the anchor masked) for the drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_pipe.drafter import AttentionMask, block_positions
from dflash_pipe.errors import UsageError
from dflash_pipe.eval import (DFlashProposer, TargetVerifier, eos_token_ids, greedy_generate, make_dflash_verifier,
                              resolve_cache_mode, speculative_generate)
from dflash_pipe.eval.runner import encode_prompt
from dflash_pipe.target import load_target, standalone_features
from tests.eval_helpers import PROMPTS, CorruptingOracle, hf_greedy, liven, tiny_drafter

NEW = 30
VOCAB = 49152


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "dflash-model-cache"


@pytest.fixture(scope="module")
def llama(model_cache):
    bundle = load_target("random:tiny-llama", dtype="float32", model_cache_dir=model_cache)
    liven(bundle.model)
    return bundle


@pytest.fixture(scope="module")
def cases(llama):
    """(prompt ids, HF greedy reference) per prompt."""
    eos = eos_token_ids(llama.model, llama.tokenizer)
    out = []
    for msgs in PROMPTS:
        ids = encode_prompt(llama.tokenizer, msgs)
        out.append((ids, hf_greedy(llama.model, ids, NEW, eos)))
    return eos, out


def _dflash(bundle, cfg, drafter):
    m = bundle.model
    return DFlashProposer(drafter, cfg, m.get_input_embeddings().weight, m.get_output_embeddings())


def test_reference_is_not_degenerate_and_greedy_baseline_matches_hf(llama, cases):
    eos, items = cases
    for ids, ref in items:
        assert len(ref) == NEW and len(set(ref)) > NEW // 2       # varied, so equality below means something
        assert greedy_generate(llama.model, ids, NEW, eos) == ref
    assert items[0][1] != items[1][1]


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_random_drafter_output_is_identical_to_target_greedy(llama, cases, block_size):
    eos, items = cases
    drafter, cfg = tiny_drafter(block_size=block_size)
    with make_dflash_verifier(llama.model, cfg, llama.num_layers, llama.hidden_size) as verifier:
        for ids, ref in items:
            r = speculative_generate(verifier, _dflash(llama, cfg, drafter), ids, block_size=block_size,
                                     max_new_tokens=NEW, eos_ids=eos)
            assert r.tokens == ref
            assert r.target_forwards == r.steps + 1                  # prefill + one verify per step
            assert 1 + sum(r.committed) == len(r.tokens)
            assert all(c == a + 1 for a, c in zip(r.accepted, r.committed))
            assert all(p == min(block_size - 1, lim) for p, lim in zip(r.proposed, r.slot_limit))


@pytest.mark.parametrize("block_size", [3, 8])
def test_oracle_is_fully_accepted_tau_equals_block_size(llama, cases, block_size):
    eos, items = cases
    verifier = TargetVerifier(llama.model)
    for ids, ref in items:
        oracle = CorruptingOracle(ids + ref, lambda step: block_size, VOCAB)
        r = speculative_generate(verifier, oracle, ids, block_size=block_size, max_new_tokens=NEW, eos_ids=eos)
        assert r.tokens == ref
        assert r.accepted == r.slot_limit                          # every budgeted draft accepted
        full = [c for c, lim in zip(r.committed, r.slot_limit) if lim == block_size - 1]
        assert full and all(c == block_size for c in full)         # tau = B on every full step
        assert r.steps == -(-(NEW - 1) // block_size)              # ceil((N - 1) / B) verify forwards


def test_partial_acceptance_counts_are_exact_and_cache_rollback_is_clean(llama, cases):
    eos, items = cases
    B = 6
    verifier = TargetVerifier(llama.model)
    for ids, ref in items:
        oracle = CorruptingOracle(ids + ref, lambda step: (step * 3) % B, VOCAB)   # 0, 3, 0, 3, ...: wrong slots
        r = speculative_generate(verifier, oracle, ids, block_size=B, max_new_tokens=NEW, eos_ids=eos)
        assert r.tokens == ref                                     # a stale KV entry would corrupt later tokens
        assert r.accepted == oracle.expected
        acc, elig = r.slot_counts()
        for k in range(1, B):                                      # per-slot counts from the raw per-step record
            assert acc[k - 1] == sum(1 for a in r.accepted if a >= k)
            assert elig[k - 1] == sum(1 for lim in r.slot_limit if lim >= k)


def test_eos_stops_generation_and_is_kept(llama, cases):
    _, items = cases
    ids, ref = items[0]
    stop = ref[7]
    first = ref.index(stop)
    expect = hf_greedy(llama.model, ids, NEW, [stop])
    assert expect == ref[:first + 1]
    verifier = TargetVerifier(llama.model)
    for wrong_at in (lambda s: 99, lambda s: 1):
        oracle = CorruptingOracle(ids + ref, wrong_at, VOCAB)
        r = speculative_generate(verifier, oracle, ids, block_size=5, max_new_tokens=NEW, eos_ids=[stop])
        assert r.tokens == expect
    assert greedy_generate(llama.model, ids, NEW, [stop]) == expect


def test_drafter_context_is_exactly_the_target_features_of_committed_tokens(llama, cases):
    """Row t of the context = HF hidden_states[id + 1] at token t, for every t < p, after crops."""
    eos, items = cases
    ids, ref = items[1]
    _, cfg = tiny_drafter(block_size=4, layer_ids=(0, 3, 7))       # 7 = last layer: final-norm convention
    with make_dflash_verifier(llama.model, cfg, llama.num_layers, llama.hidden_size) as verifier:
        oracle = CorruptingOracle(ids + ref, lambda step: step % 4, VOCAB, needs_features=True)
        r = speculative_generate(verifier, oracle, ids, block_size=4, max_new_tokens=20, eos_ids=eos)
    assert r.tokens == ref[:20] and len(oracle.seen) == r.steps and sum(r.accepted) > 0
    for tokens, feats in oracle.seen:
        p = len(tokens) - 1
        assert tokens == (ids + ref)[:p + 1]
        want = standalone_features(llama, torch.tensor(tokens[:p]), cfg.target_layer_ids).hidden_TD
        assert feats.shape == want.shape
        torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)


def test_dflash_drafts_equal_the_training_layout_with_future_context(llama, cases):
    """At inference the block sees context 0..p-1; in training the context runs on past the anchor but is
    masked at kv >= anchor. Both must give the same drafts (the drafter is used as it was trained)."""
    _, items = cases
    ids, ref = items[2]
    drafter, cfg = tiny_drafter(block_size=5, layer_ids=(1, 4, 6), seed=3)
    liven(drafter, std=0.2, seed=3)                                # so the drafts depend on the context
    seq = ids + ref
    feats = standalone_features(llama, torch.tensor(seq), cfg.target_layer_ids).hidden_TD
    prop = _dflash(llama, cfg, drafter)
    head = llama.model.get_output_embeddings()
    T = len(seq)
    ctx_pos = torch.arange(T)
    for p in (len(ids), len(ids) + 5, len(seq) - 3):
        got = prop.propose(seq[:p + 1], feats, cfg.block_size - 1)
        with torch.inference_mode():
            got_hidden = drafter(*prop.block_inputs(seq[:p + 1], feats))
        anchor = torch.tensor([p])
        mask = AttentionMask(torch.zeros(T, dtype=torch.int32), anchor, torch.zeros(1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.bool), cfg.block_size)
        block_ids = torch.tensor([seq[p]] + [cfg.mask_token_id] * (cfg.block_size - 1))
        embeds = llama.model.get_input_embeddings().weight[block_ids]
        with torch.inference_mode():
            out = drafter(feats, embeds, ctx_pos, block_positions(ctx_pos, anchor, cfg.block_size), mask)
            want = head(out[1:]).argmax(-1).tolist()
            # sensitivity: one context token fewer changes the drafter's output
            fewer = AttentionMask(mask.ctx_doc, anchor - 1, mask.block_doc, mask.block_valid, cfg.block_size)
            other = drafter(feats, embeds, ctx_pos, block_positions(ctx_pos, anchor, cfg.block_size), fewer)
        torch.testing.assert_close(got_hidden, out, rtol=1e-5, atol=1e-5)
        assert got == want
        assert (other - out).abs().max() > 1e-3


class _CachedAndRecomputed:
    """Drafts with the context cache and checks every step against recomputing the whole context."""

    needs_features = True

    def __init__(self, bundle, cfg, drafter):
        m = bundle.model
        emb, head = m.get_input_embeddings().weight, m.get_output_embeddings()
        self.cached = DFlashProposer(drafter, cfg, emb, head)
        self.recomputed = DFlashProposer(drafter, cfg, emb, head, context_cache=False)
        self.max_diff, self.resets = 0.0, 0

    def reset(self):
        self.cached.reset()
        self.resets += 1

    def propose(self, tokens, features, num):
        got, want = self.cached.block_hidden(tokens, features), self.recomputed.block_hidden(tokens, features)
        self.max_diff = max(self.max_diff, (got - want).abs().max().item())
        return self.cached.propose(tokens, features, num)


def test_context_cache_equals_recomputing_the_context_every_step(llama, cases):
    eos, items = cases
    drafter, cfg = tiny_drafter(block_size=5, layer_ids=(1, 4, 6), seed=4)
    liven(drafter, std=0.2, seed=4)
    both = _CachedAndRecomputed(llama, cfg, drafter)
    with make_dflash_verifier(llama.model, cfg, llama.num_layers, llama.hidden_size) as verifier:
        for ids, ref in items[:2]:                               # two generations through one proposer
            r = speculative_generate(verifier, both, ids, block_size=5, max_new_tokens=NEW, eos_ids=eos)
            assert r.tokens == ref
    assert both.resets == 2 and both.max_diff < 1e-5
    # fault injection: without the reset a new generation reads the previous one's cached rows
    (ids_a, ref_a), (ids_b, ref_b) = items[0], items[1]
    seq_a, seq_b = ids_a + ref_a, ids_b + ref_b
    feats_a = standalone_features(llama, torch.tensor(seq_a), cfg.target_layer_ids).hidden_TD
    feats_b = standalone_features(llama, torch.tensor(seq_b), cfg.target_layer_ids).hidden_TD
    prop, ref_prop = both.cached, both.recomputed
    prop.reset()
    prop.block_hidden(seq_a[:len(ids_a) + 1], feats_a)
    p = len(ids_a) + 4                                           # further on: the cache only appends rows
    want = ref_prop.block_hidden(seq_b[:p + 1], feats_b)
    assert (prop.block_hidden(seq_b[:p + 1], feats_b) - want).abs().max() > 1e-3
    prop.reset()
    torch.testing.assert_close(prop.block_hidden(seq_b[:p + 1], feats_b), want, rtol=1e-5, atol=1e-5)


def test_recompute_mode_gives_the_same_tokens_and_acceptance(llama, cases):
    eos, items = cases
    ids, ref = items[0]
    runs = []
    for mode in ("crop", "recompute"):
        oracle = CorruptingOracle(ids + ref, lambda step: (step * 2) % 5, VOCAB)
        runs.append(speculative_generate(TargetVerifier(llama.model, cache_mode=mode), oracle, ids, block_size=5,
                                         max_new_tokens=NEW, eos_ids=eos))
    assert runs[0].tokens == runs[1].tokens == ref
    assert runs[0].accepted == runs[1].accepted


def test_hybrid_target_recompute_mode_is_identical_too(model_cache):
    """The 'recompute' reference mode (auto is 'rollback', tests/test_eval_hybrid_rollback.py)."""
    qwen = load_target("random:tiny-qwen3.5", dtype="float32", model_cache_dir=model_cache)
    liven(qwen.model, std=0.2)
    eos = eos_token_ids(qwen.model, qwen.tokenizer)
    ids = encode_prompt(qwen.tokenizer, PROMPTS[0])
    ref = hf_greedy(qwen.model, ids, 12, eos)
    drafter, cfg = tiny_drafter(block_size=4, layer_ids=(1, 5))
    with make_dflash_verifier(qwen.model, cfg, qwen.num_layers, qwen.hidden_size, cache_mode="recompute") as verifier:
        r = speculative_generate(verifier, _dflash(qwen, cfg, drafter), ids, block_size=4, max_new_tokens=12,
                                 eos_ids=eos)
    assert r.tokens == ref
    oracle = CorruptingOracle(ids + ref, lambda step: 2, VOCAB)
    r = speculative_generate(TargetVerifier(qwen.model, cache_mode="recompute"), oracle, ids, block_size=4,
                             max_new_tokens=12, eos_ids=eos)
    assert r.tokens == ref and r.accepted == oracle.expected


def test_usage_errors(llama):
    drafter, cfg = tiny_drafter()
    with pytest.raises(UsageError, match="needs target features"):
        speculative_generate(TargetVerifier(llama.model), _dflash(llama, cfg, drafter), [1, 2, 3], block_size=4,
                             max_new_tokens=4, eos_ids=[2])
    with pytest.raises(UsageError, match="empty prompt"):
        TargetVerifier(llama.model).prefill([])
    with pytest.raises(UsageError, match="outside"):
        make_dflash_verifier(llama.model, tiny_drafter(layer_ids=(1, 9), num_target_layers=10)[1], 8, 64)


@pytest.mark.slow
def test_smollm2_real_weights_spec_decoding_is_identical():
    from dflash_pipe.config import TargetConfig
    from dflash_pipe.eval import NgramProposer

    # the default model cache, where test_pipeline_plan.py's runs convert SmolLM2 too: one conversion per
    # machine, not one per test run (tests/test_target_embedded.py tests the conversion in a dir of its own)
    shared = Path(TargetConfig().model_cache_dir).expanduser()
    smol = load_target("embedded:smollm2-135m-instruct", dtype="float32", model_cache_dir=shared)
    eos = eos_token_ids(smol.model, smol.tokenizer)
    drafter, cfg = tiny_drafter(block_size=8, layer_ids=(1, 15, 27), hidden=576, num_target_layers=30,
                                num_layers=1, heads=9, kv_heads=3, head_dim=64, intermediate=1536)
    with make_dflash_verifier(smol.model, cfg, smol.num_layers, smol.hidden_size) as verifier:
        for msgs in PROMPTS[:2]:
            ids = encode_prompt(smol.tokenizer, msgs)
            ref = hf_greedy(smol.model, ids, 32, eos)
            assert len(set(ref)) > 5
            r = speculative_generate(verifier, _dflash(smol, cfg, drafter), ids, block_size=8, max_new_tokens=32,
                                     eos_ids=eos)
            assert r.tokens == ref
            r = speculative_generate(TargetVerifier(smol.model), NgramProposer(), ids, block_size=8,
                                     max_new_tokens=32, eos_ids=eos)
            assert r.tokens == ref


@pytest.mark.gpu
def test_cuda_spec_decoding_is_identical_fp32():
    """Self-contained on a GPU box: the tiny-llama preset built directly (no tokenizer), raw-id prompts."""
    from dflash_pipe.target.loading import build_random_model

    device = torch.device("cuda")
    model = liven(build_random_model("tiny-llama", seed=0, device=device, dtype=torch.float32)).eval()
    eos = [2]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 40, 300)]
    drafter, cfg = tiny_drafter(block_size=8)
    drafter = drafter.to(device)
    prop = DFlashProposer(drafter, cfg, model.get_input_embeddings().weight, model.get_output_embeddings())
    with make_dflash_verifier(model, cfg, 8, 64) as verifier:
        for ids in prompts:
            ref = hf_greedy(model, ids, NEW, eos)
            assert len(set(ref)) > NEW // 2
            assert greedy_generate(model, ids, NEW, eos) == ref
            r = speculative_generate(verifier, prop, ids, block_size=8, max_new_tokens=NEW, eos_ids=eos)
            assert r.tokens == ref
            oracle = CorruptingOracle(ids + ref, lambda step: (step * 3) % 8, VOCAB, needs_features=True)
            r = speculative_generate(verifier, oracle, ids, block_size=8, max_new_tokens=NEW, eos_ids=eos)
            assert r.tokens == ref and r.accepted == oracle.expected
            tokens, feats = oracle.seen[-1]
            with torch.inference_mode():
                x = torch.tensor([tokens[:-1]], device=device)
                hs = model(input_ids=x, output_hidden_states=True).hidden_states
            want = torch.cat([hs[i + 1][0] for i in cfg.target_layer_ids], dim=-1)
            torch.testing.assert_close(feats, want, rtol=1e-3, atol=1e-3)
