"""regenerate --lookup-draft on CUDA (`pytest -m gpu`): (K + 1)-token steps through CUDA graphs, in fp32 (masked
attention) and bf16 (the per-row attention kernel), without host syncs in a launch.

Random tiny-llama weights as initialised (not livened): greedy answers that repeat, so the lookup finds drafts."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target.loading import build_random_model
from tests.eval_helpers import drain_backend
from tests.test_regen_overlap_gpu import EOS, _prompts

pytestmark = pytest.mark.gpu


def _repeater(dtype):
    model = build_random_model("tiny-llama", seed=0, device=torch.device("cuda"), dtype=dtype)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("k", [2, 3])
def test_lookup_gives_the_plain_answers_in_fp32_with_graphs(k):
    """fp32, CUDA graphs, 48 prompts through 16 slots: the plain backend's answers, fewer steps, drafts kept."""
    model = _repeater(torch.float32)
    prompts = _prompts(48)
    kw = dict(batch=16, max_len=256, max_new_tokens=40, dec=Decoding(), check_every=4)
    plain_be = EngineBackend(model, [2], **kw)
    plain = drain_backend(plain_be, prompts)
    be = EngineBackend(model, [2], lookup_draft=k, **kw)
    spec = drain_backend(be, prompts)
    assert sorted(spec) == list(range(48)) and spec == plain
    st = be.stats()
    assert st["kept_per_row_step"] > 1.5 and st["decode_steps"] < plain_be.stats()["decode_steps"], st
    assert be.engine.use_graphs and be.engine.graph_count >= 1


def test_lookup_in_bf16_row_attention_keeps_the_answers_and_never_syncs_in_a_launch():
    """bf16, per-row attention (4 query tokens a row through the kernel): answers equal the plain ones (bf16: a
    (K + 1)-token forward rounds differently, so at least 90 %), with EOS ending answers inside kept blocks; the
    third pass launches under sync-debug 'error'."""
    model = _repeater(torch.bfloat16)
    prompts = _prompts(40, seed=1)
    kw = dict(batch=16, max_len=256, max_new_tokens=48, dec=Decoding(temperature=0.8, greedy_after=3),
              check_every=4, attention="rows")
    plain = drain_backend(EngineBackend(model, EOS, **kw), prompts)
    be = EngineBackend(model, EOS, lookup_draft=3, **kw)
    be.engine.prefill_shapes.reuse_ratio = 1.0
    assert be.engine.row_attention(16, 4)
    runs = [drain_backend(be, prompts, sync_each=True, strict=strict) for strict in (False, False, True)]
    assert all(len(r) == 40 for r in runs) and runs[0] == runs[2]
    same = sum(runs[0][i] == plain[i] for i in range(40))
    assert same >= 36, same
    assert be.stats()["kept_per_row_step"] > 1.2


def test_the_shared_table_in_graphs_keeps_the_answers_and_drafts_repeats():
    """fp32, CUDA graphs, 24 prompts then the same 24 again through 8 slots: with the shared n-gram table (its
    scatters captured in the step's graph) the answers are the plain ones and some drafts come from the table;
    without it, the same answers."""
    model = _repeater(torch.float32)
    prompts = _prompts(24, seed=2)
    prompts = prompts + prompts
    kw = dict(batch=8, max_len=256, max_new_tokens=40, dec=Decoding(), check_every=4, lookup_draft=2)
    plain = drain_backend(EngineBackend(model, [2], **{**kw, "lookup_draft": 0}), prompts)
    be, own = EngineBackend(model, [2], **kw), EngineBackend(model, [2], lookup_shared=False, **kw)
    assert drain_backend(be, prompts) == plain == drain_backend(own, prompts)
    st, st_own = be.stats(), own.stats()
    assert st["lookup_graphs"] >= 1 and st["lookup_shared_share"] > 0.02 and st_own["lookup_shared_share"] is None
    assert st["decode_steps"] <= st_own["decode_steps"], (st, st_own)
