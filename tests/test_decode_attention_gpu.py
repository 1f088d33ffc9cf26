"""GPU checks of the per-row-length decode attention (`pytest -m gpu`): the Triton kernel against its PyTorch
reference, and the engine on it against the engine on SDPA (eager, graphed, regenerate's backend)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend, TurnRequest
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target import decode_attention as da
from dflash_pipe.target.loading import build_random_model
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import liven

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_the_reference(T, dtype):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T)
    n_rows, KVH, G, D, size, B = 50, 3, 3, 64, 513, 37
    k = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(dtype)
    v = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(dtype)
    rows = torch.randperm(n_rows, device=dev, generator=g)[:B]
    old = torch.randint(0, size - T, (B,), device=dev, generator=g)
    old[0], old[1], old[2] = 0, size - T, 63                       # empty, full, a block edge
    q = torch.randn(B, KVH, G * T, D, device=dev, generator=g).to(dtype)
    for kv_len in (size, 256):                                     # 256 cuts the longer rows (the engine's slice)
        got = da.decode_attention(q, k, v, rows, old, T, kv_len, 0.125)
        want = da.decode_attention_reference(q, k, v, rows, old, T, kv_len, 0.125)
        err = (got.float() - want.float()).abs()
        assert float(err.max()) <= 2e-2 and float(err.mean()) <= 2e-3, (float(err.max()), float(err.mean()))


def _model():
    m = build_random_model("tiny-llama", seed=0, device=torch.device("cuda"), dtype=torch.bfloat16)
    return liven(m.eval().requires_grad_(False))


def _teacher_forced(eng, prompts, tokens):
    """Prefill, then feed the same token per step to every row (the rows grow by 1, some idle): the logits."""
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    eng.forward(ids, torch.tensor([len(p) for p in prompts]), rows=list(range(len(prompts))), last_only=True)
    out = []
    for step, tok in enumerate(tokens):
        live = torch.tensor([(r + step) % 5 != 0 for r in range(len(prompts))], device="cuda")
        cur = torch.full((len(prompts), 1), tok, dtype=torch.long, device="cuda")
        out.append(eng.forward(cur, live.long()).logits[:, 0].float().clone())
    return torch.stack(out), [eng.length(r) for r in range(len(prompts))]


def test_engine_on_per_row_attention_equals_sdpa_and_its_graphs_equal_eager():
    model = _model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 17, 1, 33, 64, 9, 2, 120, 77)]
    tokens = torch.randint(0, 49152, (40,), generator=g).tolist()
    runs = {}
    for attention, graphs in (("sdpa", "off"), ("rows", "off"), ("rows", "on")):
        eng = StaticKVEngine(model, len(prompts), 200, use_graphs=graphs, kv_bucket=16, attention=attention)
        runs[attention, graphs] = _teacher_forced(eng, prompts, tokens)
    (ref, n_ref), (eager, n_eager), (graphed, n_graphed) = runs.values()
    assert n_ref == n_eager == n_graphed
    assert torch.equal(eager, graphed)                             # the same kernels, captured or not
    rel = float((eager - ref).abs().max() / ref.abs().max())
    assert rel <= 3e-2, rel                                         # bf16: two attentions, two roundings


def test_regenerate_backend_picks_per_row_attention_at_large_batch_and_decodes_like_sdpa():
    model = _model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(4, 90, (80,))]
    answers = {}
    for attention in ("auto", "sdpa"):
        be = EngineBackend(model, [2], 80, 256, 24, Decoding(), attention=attention)
        assert ("per-row attention" in be.describe) == (attention == "auto")   # 80 rows x 2 KV heads >= 132 SMs
        assert ("SDPA attention" in be.describe) == (attention == "sdpa")
        ready = [TurnRequest(None, p, key=i, order=i) for i, p in enumerate(prompts)]
        done = {}
        while ready or be.busy():
            be.launch(ready)                                       # takes what it refills from `ready`
            for c in be.collect():
                done[c.request.order] = c.tokens
        answers[attention] = [done[i] for i in range(len(prompts))]
    same = sum(a == b for a, b in zip(answers["auto"], answers["sdpa"]))
    assert same >= len(prompts) // 2, same                          # bf16 near-ties may flip a few answers
