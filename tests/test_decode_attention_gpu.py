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


def _padded_sdpa(q, k, v, rows, old, T, kv_len, scale):
    """The engine's SDPA path over the padded kv_len (what the kernel replaces), in q's dtype."""
    B, KVH, M, D = q.shape
    G = M // T
    pos = old[:, None] + torch.arange(T, device=q.device)
    visible = torch.arange(kv_len, device=q.device)[None, None, :] <= pos[:, :, None]
    mask = visible[:, None, None].expand(B, 1, G, T, kv_len).reshape(B, 1, G * T, kv_len)
    return torch.nn.functional.scaled_dot_product_attention(q, k[rows, :, :kv_len], v[rows, :, :kv_len],
                                                            attn_mask=mask, scale=scale)


@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_the_reference_as_closely_as_sdpa_does(T, dtype):
    """Against the fp32 reference on the same (rounded) inputs, the kernel's error is at most SDPA's (the path it
    replaces) x 1.5 + one half-precision ulp of the output scale, max and mean."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T)
    n_rows, KVH, G, D, size, B = 50, 3, 3, 64, 513, 37
    k = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(dtype)
    v = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(dtype)
    rows = torch.randperm(n_rows, device=dev, generator=g)[:B]
    old = torch.randint(0, size - T, (B,), device=dev, generator=g)
    old[0], old[1], old[2] = 0, size - T, 63                       # empty, full, a block edge
    q = (2 * torch.randn(B, KVH, G * T, D, device=dev, generator=g)).to(dtype)   # peaked softmax too
    for kv_len in (size, 256):                                     # 256 cuts the longer rows (the engine's slice)
        want = da.decode_attention_reference(q, k, v, rows, old, T, kv_len, 0.125).float()
        got = da.decode_attention(q, k, v, rows, old, T, kv_len, 0.125).float()
        sdpa = _padded_sdpa(q, k, v, rows, old, T, kv_len, 0.125).float()
        ulp = float(want.abs().max()) * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
        e_got, e_sdpa = (got - want).abs(), (sdpa - want).abs()
        print(f"T {T} {dtype} kv_len {kv_len}: max err kernel {float(e_got.max()):.3g} sdpa {float(e_sdpa.max()):.3g}, "
              f"mean {float(e_got.mean()):.3g} / {float(e_sdpa.mean()):.3g}")
        assert float(e_got.max()) <= 1.5 * float(e_sdpa.max()) + ulp
        assert float(e_got.mean()) <= 1.5 * float(e_sdpa.mean()) + ulp / 16


@pytest.mark.parametrize("T", [1, 16])
def test_the_token_major_layout_gives_the_grouped_layouts_numbers_bit_for_bit(T):
    """row_attention on q [B, T, H, D] (a strided slice of a joint q|k projection, as the engine passes it) equals
    decode_attention on the same q regrouped to [B, KVH, G*T, D], bit for bit, and its float64-reference error
    is the grouped one's."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7 + T)
    n_rows, KVH, G, D, size, B = 40, 3, 3, 64, 300, 29
    H = KVH * G
    k = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(n_rows, KVH, size, D, device=dev, generator=g).to(torch.bfloat16)
    rows = torch.randperm(n_rows, device=dev, generator=g)[:B]
    old = torch.randint(0, size - T, (B,), device=dev, generator=g)
    qk = torch.randn(B, T, H + KVH, D, device=dev, generator=g).to(torch.bfloat16)
    q = qk[:, :, :H]                                                    # not contiguous: the engine's view
    grouped = q.reshape(B, T, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * T, D)
    got = da.row_attention(q, k, v, rows, old, size, 0.125)
    want = da.decode_attention(grouped, k, v, rows, old, T, size, 0.125)
    assert got.shape == (B, T, H, D) and got.is_contiguous()
    assert torch.equal(got, want.reshape(B, KVH, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D))
    ref = da.row_attention_reference(q.double(), k.double(), v.double(), rows, old, size, 0.125)
    assert float((got.double() - ref).abs().max()) < 0.05


def _model(dtype=torch.bfloat16):
    m = build_random_model("tiny-llama", seed=0, device=torch.device("cuda"), dtype=torch.float32)
    return liven(m.eval().requires_grad_(False)).to(dtype)     # the same weights in both dtypes


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


def test_engine_on_per_row_attention_is_as_accurate_as_sdpa_and_its_graphs_equal_eager():
    """Teacher-forced decode steps (rows of different lengths, some idle): bf16 logits on the per-row kernel, eager
    and graphed (equal: the same kernels), against an fp32 engine on the same weights; the error is at most the bf16
    SDPA engine's x 1.25 + 1e-3 (the two differ by their own roundings, not in which keys they attend to)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 17, 1, 33, 64, 9, 2, 120, 77)]
    tokens = torch.randint(0, 49152, (40,), generator=g).tolist()
    runs = {}
    for dtype, attention, graphs in ((torch.float32, "sdpa", "off"), (torch.bfloat16, "sdpa", "off"),
                                     (torch.bfloat16, "rows", "off"), (torch.bfloat16, "rows", "on")):
        eng = StaticKVEngine(_model(dtype), len(prompts), 200, use_graphs=graphs, kv_bucket=16, attention=attention)
        runs[dtype, attention, graphs] = _teacher_forced(eng, prompts, tokens)
    (ref, n_ref), (sdpa, n_sdpa), (eager, n_eager), (graphed, n_graphed) = runs.values()
    assert n_ref == n_sdpa == n_eager == n_graphed
    assert torch.equal(eager, graphed)                             # the same kernels, captured or not
    scale = float(ref.abs().max())
    e_rows, e_sdpa = float((eager - ref).abs().max()) / scale, float((sdpa - ref).abs().max()) / scale
    m_rows, m_sdpa = float((eager - ref).abs().mean()) / scale, float((sdpa - ref).abs().mean()) / scale
    print(f"bf16 vs fp32 logits, max / mean relative error: per-row {e_rows:.4f} / {m_rows:.2e}, "
          f"SDPA {e_sdpa:.4f} / {m_sdpa:.2e}")
    assert e_rows <= 1.25 * e_sdpa + 1e-3 and m_rows <= 1.25 * m_sdpa + 1e-4


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
