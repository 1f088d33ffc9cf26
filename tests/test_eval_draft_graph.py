"""GraphedDFlashProposer (fixed-shape draft step, draft_graph.py) drafts what DFlashProposer drafts (CPU, eager).

Reference: `DFlashProposer` (itself tested against the training-layout drafter call in
test_eval_specdecode.py), run side by side on every step of whole generations.
"""

from __future__ import annotations

import torch

from dflash_pipe.eval import DFlashProposer, eos_token_ids, make_dflash_verifier, speculative_generate
from dflash_pipe.eval.draft_graph import GraphedDFlashProposer
from dflash_pipe.eval.runner import encode_prompt
from tests.eval_helpers import PROMPTS, llama, liven, tiny_drafter  # noqa: F401 - llama is a fixture


class _SideBySide:
    needs_features = True

    def __init__(self, graphed, plain):
        self.graphed, self.plain = graphed, plain
        self.steps = self.max_diff = 0

    def reset(self):
        self.graphed.reset()
        self.plain.reset()

    def propose(self, tokens, features, num):
        got = self.graphed.propose(tokens, features, num)
        want = self.plain.propose(tokens, features, num)
        assert got == want, (len(tokens), got, want)
        self.steps += 1
        return got


def test_fixed_shape_draft_step_equals_dflash_proposer_over_whole_generations(llama):
    B = 6
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 4, 7), seed=5)
    liven(drafter, std=0.2, seed=5)
    m = llama.model
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings()
    graphed = GraphedDFlashProposer(drafter, cfg, emb, head, kv_bucket=16, max_rows=24)   # grows on the first prompt
    both = _SideBySide(graphed, DFlashProposer(drafter, cfg, emb, head))
    eos = eos_token_ids(m, llama.tokenizer)
    with make_dflash_verifier(m, cfg, llama.num_layers, llama.hidden_size) as verifier:
        for msgs in PROMPTS:                                   # buffers reused across generations
            ids = encode_prompt(llama.tokenizer, msgs)
            r = speculative_generate(verifier, both, ids, block_size=B, max_new_tokens=40, eos_ids=eos)
            assert len(r.tokens) == 40
    assert both.steps > 30 and graphed.max_rows >= 24 and not graphed.use_graphs
    # a drafter whose drafts get accepted: slot outputs equal the plain proposer's on a live context
    prop = GraphedDFlashProposer(drafter, cfg, emb, head, kv_bucket=8)
    plain = DFlashProposer(drafter, cfg, emb, head)
    feats = torch.randn(60, 3 * 64)
    toks = torch.randint(3, 1000, (60,)).tolist()
    prop.reset()
    plain.reset()
    for p in (20, 21, 25, 31, 36, 37):                         # steps of 1..6 committed tokens, after an eager prompt
        assert prop.propose(toks[:p + 1], feats, B - 1) == plain.propose(toks[:p + 1], feats, B - 1)


def test_fault_injection_a_skipped_context_update_changes_the_drafts(llama, monkeypatch):
    B = 6
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 4, 7), seed=5)
    liven(drafter, std=0.2, seed=5)
    m = llama.model
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings()
    monkeypatch.setattr(GraphedDFlashProposer, "_update", lambda self: None)
    prop, plain = GraphedDFlashProposer(drafter, cfg, emb, head, kv_bucket=8), DFlashProposer(drafter, cfg, emb, head)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(60, 3 * 64, generator=g)
    toks = torch.randint(3, 1000, (60,), generator=g).tolist()
    prop.reset()
    plain.reset()
    differ = sum(prop.propose(toks[:p + 1], feats, B - 1) != plain.propose(toks[:p + 1], feats, B - 1)
                 for p in (20, 21, 25, 31, 36, 37))
    assert differ >= 3                                           # the rows it skipped are visible in the drafts


def test_drafter_linears_on_their_chosen_formulation_draft_the_same_tokens(llama, monkeypatch):
    """The GPU's per-shape GEMM choice, forced on the CPU (timing faked: split-K fastest): same drafts."""
    import copy

    from dflash_pipe.target import linear_choice as lc
    from dflash_pipe.target.small_batch_ops import ChosenLinear

    B = 6
    drafter, cfg = tiny_drafter(block_size=B, layer_ids=(1, 4, 7), seed=5)
    liven(drafter, std=0.2, seed=5)
    m = llama.model
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings()
    monkeypatch.setattr(lc, "_CACHE", {})
    monkeypatch.setattr(lc, "_graph_time_us", lambda fn, *a: 1.0 if fn is lc.CANDIDATES["split_k4"][0] else 10.0)
    chooser = lc.LinearChooser(torch.device("cpu"))
    chooser.device = torch.device("cuda")                        # as if on a GPU
    graphed = GraphedDFlashProposer(copy.deepcopy(drafter), cfg, emb, head, kv_bucket=8, chooser=chooser)
    plain = DFlashProposer(drafter, cfg, emb, head)
    chosen = [mod.forward for mod in graphed.drafter.modules() if isinstance(mod.forward, ChosenLinear)]
    assert chosen and all(B in c.how for c in chosen) and (B - 1) in graphed._head.how
    assert not any(isinstance(mod.forward, ChosenLinear) for mod in drafter.modules())   # the plain one untouched
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(60, 3 * 64, generator=g)
    toks = torch.randint(3, 1000, (60,), generator=g).tolist()
    graphed.reset()
    plain.reset()
    for p in (20, 21, 25, 31, 36, 37):
        assert graphed.propose(toks[:p + 1], feats, B - 1) == plain.propose(toks[:p + 1], feats, B - 1), p
