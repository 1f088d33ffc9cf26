"""GPU (`pytest -m gpu`): the engine's small-batch ops on CUDA in fp32 — graphs == eager == HF forward, every op
mode; TF32 stays off; the linear choice is made and kept; a speculative step reads the host twice, no more."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_pipe.eval.draft_graph import GraphedDFlashProposer
from dflash_pipe.eval.engine_step import EngineTarget, EngineVerifier, engine_greedy_generate
from dflash_pipe.eval.specdecode import speculative_generate
from dflash_pipe.target.loading import build_random_model
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import hf_greedy, liven, tiny_drafter

pytestmark = pytest.mark.gpu
VOCAB = 49152


@pytest.fixture(scope="module")
def model():
    m = build_random_model("tiny-llama", seed=0, device=torch.device("cuda"), dtype=torch.float32)
    return liven(m.eval().requires_grad_(False))


def _steps(eng, seq, widths):
    """Logits of `seq` fed in pieces of `widths` tokens (prompt first) on a fresh engine row, concatenated."""
    eng.reset()
    out, at = [], 0
    for w in widths:
        o = eng.forward(torch.tensor([seq[at:at + w]]))
        out.append(o.logits[0].clone())
        at += w
    return torch.cat(out)


@pytest.mark.parametrize("kw", [{}, {"attention": "sdpa"}, {"attention": "explicit", "linear": "linear"},
                                {"fused": False, "attention": "sdpa", "linear": "linear"}])
def test_graphs_equal_eager_equal_hf_in_fp32(model, kw):
    seq = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([seq], device="cuda"), use_cache=False).logits[0]
    widths = [150] + [16, 1, 16, 1, 16]                         # verify blocks and decode steps, graphed
    runs = {}
    for graphs in ("on", "off"):
        eng = StaticKVEngine(model, 1, 256, use_graphs=graphs, kv_bucket=64, **kw)
        runs[graphs] = _steps(eng, seq, widths)
        if graphs == "on":
            assert eng.graph_count >= 2
            assert not torch.backends.cuda.matmul.allow_tf32
            if kw.get("linear", "auto") == "auto":
                assert eng.ops.chooser.table                    # shapes timed at M 1 and 16
    n = sum(widths)
    for got in runs.values():
        assert float((got - ref[:n]).abs().max() / ref[:n].abs().max()) <= 1e-4, kw
    assert float((runs["on"] - runs["off"]).abs().max() / runs["off"].abs().max()) <= 1e-5


def test_spec_step_reads_the_host_twice_and_output_equals_target_only(model, monkeypatch):
    drafter, cfg = tiny_drafter(block_size=8, layer_ids=(1, 3, 7))
    drafter = drafter.to("cuda")
    liven(drafter, std=0.2, seed=4)
    target = EngineTarget(model, cfg.target_layer_ids, max_len=512, limit=4096)
    prop = GraphedDFlashProposer(drafter, cfg, model.get_input_embeddings().weight, model.get_output_embeddings(),
                                 kv_bucket=64)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_greedy(model, ids, 48, [2])
    assert engine_greedy_generate(target, ids, 48, [2]) == ref
    with EngineVerifier(target, cfg.target_layer_ids, 8) as v:
        first = speculative_generate(v, prop, ids, block_size=8, max_new_tokens=48, eos_ids=[2])   # captures
    assert first.tokens == ref
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real(*a))[1])
    real()
    with warnings.catch_warnings(record=True) as rec, EngineVerifier(target, cfg.target_layer_ids, 8) as v:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = speculative_generate(v, prop, ids, block_size=8, max_new_tokens=48, eos_ids=[2])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in rec if "synchronizing CUDA operation" in str(w.message)]
    assert r.tokens == ref and r.steps > 5
    assert len(calls) <= 1                                      # one device sync per generation, at its end
    assert len(syncs) <= 2 * r.steps + 4, [f"{w.filename}:{w.lineno}" for w in syncs][:12]
