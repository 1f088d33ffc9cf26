"""GPU: the eval's engine path (CUDA graphs) equals the HF path token for token, fp32 (`pytest -m gpu`).

Self-contained: the tiny-llama preset built on the GPU (no tokenizer), raw-id prompts around the
engine's 128-token KV buckets, so verify and baseline steps replay graphs across bucket changes.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval import DFlashProposer, greedy_generate, make_dflash_verifier, speculative_generate
from dflash_pipe.eval.draft_graph import GraphedDFlashProposer
from dflash_pipe.eval.engine_step import EngineTarget, EngineVerifier, engine_greedy_generate
from dflash_pipe.target.loading import build_random_model
from tests.eval_helpers import CorruptingOracle, hf_greedy, liven, tiny_drafter

pytestmark = pytest.mark.gpu
VOCAB = 49152
NEW = 60


def test_graphed_engine_eval_equals_hf_fp32():
    device = torch.device("cuda")
    model = liven(build_random_model("tiny-llama", seed=0, device=device, dtype=torch.float32)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 100, 250)]
    drafter, cfg = tiny_drafter(block_size=8, layer_ids=(1, 3, 7))
    drafter = drafter.to(device)
    liven(drafter, std=0.2, seed=4)
    target = EngineTarget(model, cfg.target_layer_ids, max_len=512, limit=4096)
    assert target.engine.use_graphs
    args = (drafter, cfg, model.get_input_embeddings().weight, model.get_output_embeddings())
    prop, graphed = DFlashProposer(*args), GraphedDFlashProposer(*args, kv_bucket=64)
    assert graphed.use_graphs
    for ids in prompts:
        ref = hf_greedy(model, ids, NEW, [2])
        assert len(set(ref)) > NEW // 3
        assert greedy_generate(model, ids, NEW, [2]) == ref
        assert engine_greedy_generate(target, ids, NEW, [2]) == ref
        runs = []
        for verifier in (make_dflash_verifier(model, cfg, 8, 64), EngineVerifier(target, cfg.target_layer_ids, 8)):
            with verifier:
                oracle = CorruptingOracle(ids + ref, lambda s: (s * 3) % 8, VOCAB, needs_features=True)
                r = speculative_generate(verifier, oracle, ids, block_size=8, max_new_tokens=NEW, eos_ids=[2])
                d = speculative_generate(verifier, prop, ids, block_size=8, max_new_tokens=NEW, eos_ids=[2])
            runs.append((r, d, oracle.seen[-1][1]))
        (r_hf, d_hf, f_hf), (r_en, d_en, f_en) = runs
        assert r_en.tokens == r_hf.tokens == ref == d_en.tokens == d_hf.tokens
        assert r_en.accepted == r_hf.accepted and d_en.accepted == d_hf.accepted
        torch.testing.assert_close(f_en, f_hf, rtol=1e-3, atol=1e-3)
        with EngineVerifier(target, cfg.target_layer_ids, 8) as verifier:   # graphed drafter on the graphed target
            gd = speculative_generate(verifier, graphed, ids, block_size=8, max_new_tokens=NEW, eos_ids=[2])
        assert gd.tokens == ref and gd.accepted == d_hf.accepted and gd.proposed == d_hf.proposed
    # graphs are per (B, T, attended-length bucket, last_only): a handful, not one per step
    assert 0 < target.engine.graph_count <= 24
    assert 0 < graphed.graph_count <= 8                        # one update graph + one per 64-row bucket
