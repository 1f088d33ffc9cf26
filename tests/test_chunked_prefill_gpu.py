"""GPU checks of the chunked prefill (`pytest -m gpu`): graphed == eager == the padded prefill, live rows untouched,
and regenerate's answers through it equal the padded path's (fp32). Random tiny-llama weights, synthetic ids."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target.chunked_prefill import CHUNK
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import drain_backend
from tests.test_static_forward_gpu import LENS, _model, _prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_chunked_prefill_equals_eager_and_the_padded_prefill(dtype):
    """Three calls of three prompts (5-6 chunks each, all in the 8-chunk bucket): the first eager, the second
    captured, the third replayed; logits and K/V equal an eager chunked engine's and a padded engine's, rows
    outside each call keep their K/V and lengths, and bf16 takes the per-row kernel by default."""
    model = _model(dtype)
    prompts = _prompts()
    groups = [([prompts[0], prompts[1], prompts[3]], [4, 0, 7]), ([prompts[2], prompts[4], prompts[6]], [1, 5, 2]),
              ([prompts[5], prompts[7], prompts[0]], [3, 6, 9])]
    runs = {}
    for name, kw in (("graphs", dict(use_graphs="on", prefill_layout="chunks")),
                     ("eager", dict(use_graphs="off", prefill_layout="chunks")),
                     ("padded", dict(use_graphs="off", prefill_layout="padded"))):
        eng = StaticKVEngine(model, 10, 160, kv_bucket=16, bucketed_prefill=True, **kw)
        logits, untouched = [], True
        for ps, rows in groups:
            before = eng.k_cache[:, :10].clone(), eng.v_cache[:, :10].clone(), eng.lengths[:10].clone()
            logits.append(eng.prefill(ps, rows).float().clone())
            others = [r for r in range(10) if r not in rows]
            untouched &= bool(torch.equal(eng.k_cache[:, others], before[0][:, others])
                              and torch.equal(eng.v_cache[:, others], before[1][:, others])
                              and torch.equal(eng.lengths[others], before[2][others]))
        assert untouched and eng.length(10) == 0
        if name == "graphs":
            assert eng.last_prefill_shape == (8, CHUNK) and eng.prefill_graph_count == 1
        runs[name] = (torch.stack(logits), eng.k_cache.float().clone(), eng.v_cache.float().clone(),
                      [eng.length(r) for r in range(10)])
    assert (StaticKVEngine(model, 4, 64, bucketed_prefill=True).prefill_layout
            == ("chunks" if dtype == torch.bfloat16 else "padded"))
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    ref_l, ref_k, ref_v, ref_n = runs["padded"]
    for name in ("graphs", "eager"):
        l, k, v, n = runs[name]
        assert n == ref_n
        assert float((l - ref_l).abs().max() / ref_l.abs().max()) <= tol, name
        for r, m in enumerate(n):
            if m == 0:  # row 8 takes no prompt
                continue
            for a, b in ((k, ref_k), (v, ref_v)):
                assert float((a[:, r, :, :m] - b[:, r, :, :m]).abs().max()) <= tol * float(b.abs().max()), (name, r)
    assert torch.equal(runs["graphs"][0][2].argmax(-1), runs["eager"][0][2].argmax(-1))


def test_regenerate_backend_answers_through_chunked_prefills_equal_the_padded_ones_fp32():
    """Continuous batching on graphs, 8 slots, 24 prompts (refills mid-run), greedy, fp32: every answer equals the
    padded prefill's; the chunked run pads less."""
    model = _model(torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in LENS * 3]
    got, pad = {}, {}
    for layout in ("chunks", "padded"):
        be = EngineBackend(model, [], batch=8, max_len=256, max_new_tokens=24, dec=Decoding(), check_every=4,
                           prefill_layout=layout)
        assert be.engine.prefill_layout == layout
        got[layout] = drain_backend(be, prompts)
        pad[layout] = be.prefill_padded
    assert got["chunks"] == got["padded"] and len(got["chunks"]) == len(prompts)
    assert pad["chunks"] < pad["padded"]
