"""GPU: the rollback cache mode on the 27B-shaped random hybrid through FLA kernels (`pytest -m gpu`).

Self-contained (no tokenizer, raw-id prompts). fp32 on an 8-layer cut of the 27B shape (hidden 5120,
24/4 attention heads of 256, 16/48 GDN heads of 128: the real per-layer shapes) for exact token
identity with target-only greedy decoding; bf16 on the whole 64-layer shape for the state after a
rejected step against a fresh prefill (bf16 rounding, so a tolerance instead of identity).
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval import TargetVerifier, greedy_generate, speculative_generate
from dflash_pipe.eval.recurrent_state import cache_tensors
from dflash_pipe.eval.target_step import cache_kwarg_name, new_dynamic_cache
from dflash_pipe.target.loading import build_random_model
from tests.eval_helpers import CorruptingOracle, hf_greedy

pytestmark = pytest.mark.gpu
VOCAB = 248320
NEW = 40


def _prompts(lengths):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_27b_shape_fp32_rollback_is_identical_to_target_greedy():
    types = ["linear_attention"] * 3 + ["full_attention"]
    model = build_random_model("qwen3.5-27b-shape", seed=0, device=torch.device("cuda"), dtype=torch.float32,
                               num_hidden_layers=8, layer_types=types * 2).eval()
    verifier = TargetVerifier(model)
    assert verifier.mode == "rollback"
    for ids in _prompts([5, 70, 300]):                      # around FLA's 64-token chunks
        ref = hf_greedy(model, ids, NEW, [0])
        assert len(set(ref)) > 3, "degenerate greedy output: the identity check would be vacuous"
        assert greedy_generate(model, ids, NEW, [0]) == ref
        oracle = CorruptingOracle(ids + ref, lambda step: (0, 3, 99, 1, 8)[step % 5], VOCAB)
        r = speculative_generate(verifier, oracle, ids, block_size=16, max_new_tokens=NEW, eos_ids=[0])
        assert r.tokens == ref
        assert r.refeeds > 0 and r.refeeds < r.steps          # rejections and full acceptances both ran
    verifier.close()


def test_27b_shape_bf16_state_after_a_rejected_step_equals_a_fresh_prefill():
    model = build_random_model("qwen3.5-27b-shape", seed=0, device=torch.device("cuda"),
                               dtype=torch.bfloat16).eval()
    (ids,) = _prompts([200])
    verifier = TargetVerifier(model)
    verifier.prefill(ids)
    g = torch.Generator().manual_seed(3)
    for accept in (4, 15, 0):
        target = verifier.verify(torch.randint(3, VOCAB, (15,), generator=g).tolist())
        verifier.commit(accept, target[accept])
    fresh = new_dynamic_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([verifier.tokens[:-1]], device="cuda"), use_cache=True, logits_to_keep=1,
              **{cache_kwarg_name(model): fresh})
    got, want = cache_tensors(verifier.cache), cache_tensors(fresh)
    assert [a.shape for a in got] == [b.shape for b in want]
    worst = max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)) for a, b in zip(got, want))
    assert worst < 5e-2, worst
    verifier.close()
    del model
    torch.cuda.empty_cache()
