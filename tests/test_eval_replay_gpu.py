"""GPU: `eval --replay` on the eval's CUDA path (static engine with graphs, graphed DFlash drafting), fp32: the
replayed steps equal the decoded ones (`pytest -m gpu`). Self-contained (tiny-llama built on the GPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval import speculative_generate
from dflash_pipe.eval.draft_graph import GraphedDFlashProposer
from dflash_pipe.eval.engine_step import EngineTarget, EngineVerifier, engine_greedy_generate
from dflash_pipe.eval.ngram import NgramProposer
from dflash_pipe.eval.replay import replay_generate, same_steps
from dflash_pipe.target.loading import build_random_model
from tests.eval_helpers import CorruptingOracle, liven, tiny_drafter

pytestmark = pytest.mark.gpu
VOCAB, NEW, B = 49152, 60, 8


def test_replay_equals_graphed_decoding_fp32():
    device = torch.device("cuda")
    model = liven(build_random_model("tiny-llama", seed=0, device=device, dtype=torch.float32)).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 120, 260)]
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 3, 7))
    drafter = drafter.to(device)
    liven(drafter, std=0.2, seed=4)
    target = EngineTarget(model, cfg.target_layer_ids, max_len=512, limit=4096)
    args = (drafter, cfg, model.get_input_embeddings().weight, model.get_output_embeddings())
    graphed = GraphedDFlashProposer(*args, kv_bucket=64)
    assert target.engine.use_graphs and graphed.use_graphs
    for ids in prompts:
        ref = engine_greedy_generate(target, ids, NEW, [2])
        for name, make in (("oracle", lambda: CorruptingOracle(ids + ref, lambda s: (s * 3) % B, VOCAB,
                                                                 needs_features=True)),
                           ("dflash", lambda: graphed), ("ngram", NgramProposer)):
            runs = []
            for replay in (False, True):
                prop = make()
                with EngineVerifier(target, cfg.target_layer_ids, block_size=B) as v:
                    fn = replay_generate if replay else speculative_generate
                    kw = dict(block_size=B, max_new_tokens=NEW, eos_ids=[2])
                    runs.append(fn(v, prop, ids, ref, **kw) if replay else fn(v, prop, ids, **kw))
            dec, rep = runs
            assert dec.tokens == rep.tokens == ref, name
            assert same_steps(dec, rep), (name, dec.accepted, rep.accepted)
            if name == "oracle":
                assert 0 < sum(rep.accepted) < sum(rep.proposed)
