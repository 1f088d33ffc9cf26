"""The eval on the static-KV engine (engine_step.py) equals the HF-cache path, token for token (CPU, eager).

References: the HF-cache `TargetVerifier` / `greedy_generate` (themselves tested against transformers'
`generate` in test_eval_specdecode.py) and HF `output_hidden_states` forwards for the features.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.errors import UsageError
from dflash_pipe.eval import DFlashProposer, eos_token_ids, greedy_generate, make_dflash_verifier
from dflash_pipe.eval import speculative_generate
from dflash_pipe.eval.engine_step import EngineTarget, EngineVerifier, engine_greedy_generate, resolve_engine
from dflash_pipe.eval.runner import encode_prompt
from dflash_pipe.target import standalone_features
from tests.eval_helpers import PROMPTS, CorruptingOracle, llama, liven, tiny_drafter  # noqa: F401 - fixture

NEW = 30
VOCAB = 49152


@pytest.fixture(scope="module")
def cases(llama):
    eos = eos_token_ids(llama.model, llama.tokenizer)
    return eos, [encode_prompt(llama.tokenizer, m) for m in PROMPTS]


def test_engine_greedy_equals_the_hf_cache_baseline_and_stops_at_eos(llama, cases):
    eos, prompts = cases
    target = EngineTarget(llama.model, (), max_len=16, limit=4096)     # small: the first prompt grows it
    for ids in prompts:
        ref = greedy_generate(llama.model, ids, NEW, eos)
        assert len(set(ref)) > NEW // 2
        assert engine_greedy_generate(target, ids, NEW, eos) == ref
        stop = ref[9]
        assert engine_greedy_generate(target, ids, NEW, [stop]) == ref[:ref.index(stop) + 1]
        assert engine_greedy_generate(target, ids, 1, eos) == ref[:1]
    assert target.engine.max_len >= len(prompts[0]) + NEW


@pytest.mark.slow
@pytest.mark.parametrize("layer_ids", [(1, 3, 7), (2, 4, 7)])   # a column subset of the engine's capture; all of it
def test_engine_verifier_equals_the_hf_verifier_tokens_acceptance_and_features(llama, cases, layer_ids):
    eos, prompts = cases
    B = 5
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=layer_ids, seed=4)
    liven(drafter, std=0.2, seed=4)
    target = EngineTarget(llama.model, sorted(set(layer_ids) | {2}), max_len=256, limit=4096)
    m = llama.model
    for ids in prompts[:2]:
        ref = greedy_generate(m, ids, NEW, eos)
        runs = []
        for verifier in (make_dflash_verifier(m, cfg, llama.num_layers, llama.hidden_size),
                         EngineVerifier(target, cfg.target_layer_ids, block_size=B)):
            with verifier:
                oracle = CorruptingOracle(ids + ref, lambda s: (s * 3) % B, VOCAB, needs_features=True)
                r = speculative_generate(verifier, oracle, ids, block_size=B, max_new_tokens=NEW, eos_ids=eos)
                prop = DFlashProposer(drafter, cfg, m.get_input_embeddings().weight, m.get_output_embeddings())
                d = speculative_generate(verifier, prop, ids, block_size=B, max_new_tokens=NEW, eos_ids=eos)
            runs.append((r, oracle, d))
        (r_hf, o_hf, d_hf), (r_en, o_en, d_en) = runs
        assert r_en.tokens == r_hf.tokens == ref == d_en.tokens == d_hf.tokens
        assert r_en.accepted == r_hf.accepted and 0 < sum(r_en.accepted) < sum(r_en.proposed)
        assert d_en.accepted == d_hf.accepted                        # the drafter saw the same features
        assert r_en.target_forwards == r_hf.target_forwards
        for (tok, f_en), (_, f_hf) in zip(o_en.seen, o_hf.seen):   # two attention kernels (SDPA vs the engine's
            rel = float((f_en.double() - f_hf.double()).norm() / f_hf.double().norm())   # explicit few-query math)
            assert rel < 1e-5, rel
            torch.testing.assert_close(f_en, f_hf, rtol=1e-3, atol=1e-3)
        tok, f_en = o_en.seen[-1]
        want = standalone_features(llama, torch.tensor(tok[:-1]), list(layer_ids)).hidden_TD
        # fp32 against a full forward (another attention kernel, other summation order): the relative error
        # of the whole feature block, as METHOD.md measures it (a wrong row or position gives O(1)), and a
        # per-element bound; one element of 12,480 once missed the old per-element 1e-4 by 7e-5
        rel = float((f_en.double() - want.double()).norm() / want.double().norm())
        assert rel < 1e-5, rel
        torch.testing.assert_close(f_en, want, rtol=1e-3, atol=1e-3)


def test_engine_choice_and_errors(llama, tmp_path):
    cpu = torch.device("cpu")
    assert resolve_engine(llama.model, "auto", cpu)[0] == "hf"          # the engine is for CUDA by default
    assert resolve_engine(llama.model, "static", cpu)[0] == "static"
    assert resolve_engine(llama.model, "hf", torch.device("cuda"))[0] == "hf"
    from dflash_pipe.target import load_target

    qwen = load_target("random:tiny-qwen3.5", dtype="float32", with_tokenizer=False)
    assert resolve_engine(qwen.model, "auto", torch.device("cuda"))[0] == "hf"    # hybrid: HF cache + rollback
    with pytest.raises(UsageError, match="static"):
        resolve_engine(qwen.model, "static", cpu)
    with pytest.raises(UsageError, match="one of"):
        resolve_engine(llama.model, "fast", cpu)
    target = EngineTarget(llama.model, (1,), max_len=8, limit=20)
    with pytest.raises(UsageError, match="needs 32 positions, the target has 20"):
        engine_greedy_generate(target, list(range(3, 14)), 20, [2])


def test_run_eval_on_the_engine_with_fixed_shape_drafting_equals_the_hf_path(llama, tmp_path):
    from dflash_pipe.drafter import export_drafter
    from dflash_pipe.eval.runner import run_eval
    from tests.test_eval_runner import _cfg, _untimed

    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp_path / "train" / "export")
    reports = {e: run_eval(_cfg(tmp_path, prompts="mtbench", max_prompts=1, mtbench_turns=2, engine=e, draft_graphs=g,
                                output_dir=str(tmp_path / e)), bundle=llama)
               for e, g in (("hf", "off"), ("static", "on"))}             # "on" on the CPU: the fixed-shape step, eager
    assert reports["static"]["cache_mode"] == "static" and reports["hf"]["cache_mode"] == "crop"
    assert "static KV" in reports["static"]["target_forward"]
    s_hf, s_en = reports["hf"]["sets"]["mtbench"], reports["static"]["sets"]["mtbench"]
    assert s_en["generations"] == 2 and s_en["dflash"]["identical_to_target"] == 1.0
    assert _untimed(s_en) == _untimed(s_hf)
    assert s_en["dflash"]["speedup"] is not None
    with pytest.raises(UsageError, match="not cache mode 'recompute'"):
        run_eval(_cfg(tmp_path, engine="static", cache_mode="recompute"), bundle=llama)
