"""GPU checks of decode steps that carry prefills (`pytest -m gpu`, target/mixed_step.py): graphed == eager == a
chunked prefill then the decode step, and regenerate's answers through them equal the chunked path's (fp32).
Random tiny-llama weights, synthetic ids."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target.mixed_step import decode_with_prefill
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import drain_backend
from tests.test_static_forward_gpu import LENS, _model, _prompts

pytestmark = pytest.mark.gpu
B = 96                      # B x KV heads fills the SMs: the decode part takes the per-row kernel in bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_mixed_steps_equal_eager_and_a_chunked_prefill_then_the_step(dtype):
    """48 rows decoding (lengths 1-64), then three steps each prefilling three prompts into empty rows (the first
    eager, the second captured, the third replayed, one chunk bucket): decode logits, prompt logits, K/V and
    lengths equal an eager engine's and a reference engine's separate chunked prefill + decode step."""
    model = _model(dtype)
    prompts = _prompts()
    g = torch.Generator().manual_seed(1)
    start = [torch.randint(0, 49152, (LENS[i % 8],), generator=g).tolist() for i in range(48)]
    groups = [([prompts[0], prompts[1], prompts[3]], [50, 48, 63]), ([prompts[2], prompts[4], prompts[6]],
                                                                      [49, 55, 60]),
              ([prompts[5], prompts[7], prompts[0]], [51, 52, 53])]
    steps = [torch.randint(0, 49152, (B, 1), generator=g).cuda() for _ in groups]
    runs = {}
    for name in ("graphs", "eager", "reference"):
        eng = StaticKVEngine(model, B, 160, kv_bucket=16, bucketed_prefill=True, prefill_layout="chunks",
                             use_graphs="on" if name == "graphs" else "off")
        for i in range(0, 48, 16):
            eng.prefill(start[i:i + 16], list(range(i, i + 16)))
        active = torch.zeros(B, dtype=torch.long, device="cuda")
        logits, firsts = [], []
        for (ps, rows), ids in zip(groups, steps):
            active[:48] = 1
            eng.reset(rows)                      # as regenerate does before a refill (each step grew every row)
            if name == "reference":
                firsts.append(eng.prefill(ps, rows).float().clone())
                logits.append(eng.forward(ids, active).logits.float().clone())
            else:
                lg, first = decode_with_prefill(eng, ids, active, ps, rows)
                logits.append(lg.float().clone())
                firsts.append(first.float().clone())
        if name == "graphs":
            assert [k for k in eng._graphs if k[0] == "mixed"] == [("mixed", B, 8)]
        runs[name] = (torch.stack(logits), torch.stack(firsts), eng.k_cache.float().clone(),
                      eng.v_cache.float().clone(), [eng.length(r) for r in range(B)])
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    ref_l, ref_f, ref_k, ref_v, ref_n = runs["reference"]
    for name in ("graphs", "eager"):
        lg, first, k, v, n = runs[name]
        assert n == ref_n
        for a, b in ((lg[:, :48], ref_l[:, :48]), (first, ref_f)):
            assert float((a - b).abs().max() / b.abs().max()) <= tol, name
        for r, m in enumerate(n):
            if m:
                for a, b in ((k, ref_k), (v, ref_v)):
                    assert float((a[:, r, :, :m] - b[:, r, :, :m]).abs().max()) <= tol * float(b.abs().max()), r
    assert torch.equal(runs["graphs"][1].argmax(-1), runs["eager"][1].argmax(-1))


def test_regenerate_backend_answers_through_mixed_steps_equal_the_chunked_ones_fp32():
    """Continuous batching on graphs, 8 slots, 24 prompts, answers ending at many steps (a fifth of the
    vocabulary is EOS), greedy, fp32: every answer equals the chunked prefill's; refills ride in steps."""
    model = _model(torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in LENS * 3]
    eos = list(range(2, 49152, 5))
    got = {}
    for layout in ("chunks", "mixed"):
        be = EngineBackend(model, eos, batch=8, max_len=256, max_new_tokens=24, dec=Decoding(), check_every=4,
                           prefill_layout=layout, snapshot_lag=1)
        got[layout] = drain_backend(be, prompts)
        if layout == "mixed":
            assert be.stats()["prefills_in_steps"] >= 2
    assert got["mixed"] == got["chunks"] and len(got["mixed"]) == len(prompts)
