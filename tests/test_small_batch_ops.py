"""The engine's small-batch ops (CPU): few-query attention vs float64, fused projections keep the HF model,
every linear formulation equals F.linear, the engine equals HF in every op mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_pipe.target.linear_choice import CANDIDATES, LinearChooser, extra_for
from dflash_pipe.target.small_batch_ops import few_query_attention, few_query_bias, fused_views_intact
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.test_static_forward import _hf, _model, _rel, _small


@pytest.mark.parametrize("amp", [1.0, 4.0])
def test_few_query_attention_equals_a_float64_reference_as_closely_as_sdpa(amp):
    g = torch.Generator().manual_seed(0)
    B, KVH, R, S, D = 2, 3, 48, 300, 64
    q = torch.randn(B, KVH, R, D, generator=g) * amp
    k = torch.randn(B, KVH, S, D, generator=g) * amp
    v = torch.randn(B, KVH, S, D, generator=g)
    vis = torch.rand(B, 1, R, S, generator=g) < 0.7
    vis[..., 0] = True
    scale = D ** -0.5
    bias64 = torch.zeros(vis.shape, dtype=torch.float64).masked_fill(~vis, float("-inf"))
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale + bias64, -1) @ v.double()
    out = few_query_attention(q, k, v, few_query_bias(vis, KVH, torch.float32), scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scale)
    err, err_sdpa = float((out.double() - ref).abs().max()), float((sdpa.double() - ref).abs().max())
    assert err <= max(2 * err_sdpa, 1e-6), (err, err_sdpa)
    wrong = few_query_attention(q, k, v, few_query_bias(vis.roll(1, -1), KVH, torch.float32), scale)
    assert float((wrong.double() - ref).abs().max()) > 1e-2          # the mask matters


def test_fused_projections_keep_the_hf_model_and_share_memory():
    model = _small(__import__("transformers").Qwen2Config)          # q/k/v biases
    before = {n: p.clone() for n, p in model.named_parameters()}
    seq = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=seq).logits
    eng = StaticKVEngine(model, max_batch=1, max_len=32)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, p in after.items():
        assert torch.equal(p, before[n]) and p.requires_grad == before[n].requires_grad, n
    with torch.no_grad():
        assert torch.equal(model(input_ids=seq).logits, ref)       # the HF model computes what it did
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    W, b, sizes = attn.q_proj._dflash_fused
    assert sizes == [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    assert attn.k_proj.weight.data_ptr() == W[sizes[0]].data_ptr() and attn.v_proj.bias.data_ptr() == b[-sizes[2]].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj._dflash_fused[0][mlp.gate_proj.out_features].data_ptr()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) < len(list(model.parameters()))            # views, not copies
    with torch.no_grad():                                          # a write through the HF parameter reaches the engine
        attn.v_proj.weight.mul_(2.0)
    assert torch.equal(W[-sizes[2]:], attn.v_proj.weight)
    StaticKVEngine(model, max_batch=1, max_len=32)                  # a rebuilt engine reuses the fusion
    assert attn.q_proj._dflash_fused[0] is W and fused_views_intact([attn.q_proj, attn.k_proj, attn.v_proj],
                                                                    attn.q_proj._dflash_fused)
    with torch.no_grad():
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.clone())    # replaced: the views are gone
    assert not fused_views_intact([attn.q_proj, attn.k_proj, attn.v_proj], attn.q_proj._dflash_fused)
    StaticKVEngine(model, max_batch=1, max_len=32)                  # fuses again from the current weights
    assert attn.q_proj._dflash_fused[0] is not W


@pytest.mark.parametrize("name", sorted(CANDIDATES))
@pytest.mark.parametrize("bias", [False, True])
def test_every_linear_formulation_equals_f_linear(name, bias):
    fn, applies, _ = CANDIDATES[name]
    N, K = 96, 64
    if not applies(N, K, torch.device("cpu")):
        pytest.skip(f"{name} is CUDA-only")
    g = torch.Generator().manual_seed(0)
    W, x = torch.randn(N, K, generator=g), torch.randn(16, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    want = x.double() @ W.double().t() + (b.double() if bias else 0)
    got = fn(x, W, b, extra_for(name, W, b))
    assert got.shape == (16, N) and got.is_contiguous()
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_linear_choice_on_the_cpu_is_f_linear_without_timing():
    ch = LinearChooser(torch.device("cpu"))
    assert ch.choose(torch.randn(8, 4), None, 16) == "linear" and ch.tuned_s == 0.0 and not ch.table
    with pytest.raises(ValueError, match="linear mode"):
        LinearChooser(torch.device("cpu"), "fastest")


@pytest.mark.parametrize("kw", [{"attention": "sdpa", "fused": False}, {"attention": "explicit", "fused": True}])
def test_engine_equals_the_full_forward_in_each_op_mode(kw):
    model = _model("tiny-llama")
    seq = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref, hid = _hf(model, seq, (2,))
    eng = StaticKVEngine(model, max_batch=1, max_len=64, capture_layer_ids=(2,), kv_bucket=16, **kw)
    assert eng.ops.explicit_attention(1, eng.kv_heads) == (kw["attention"] == "explicit")
    a = eng.forward(torch.tensor([seq[:24]]))
    b = eng.forward(torch.tensor([seq[24:]]))                     # T = 16: the verify shape
    assert _rel(torch.cat([a.logits[0], b.logits[0]]), ref) <= 1e-5
    assert _rel(torch.cat([a.hidden[0], b.hidden[0]]), hid) <= 1e-5
    eng.truncate(0, 39)                                           # T = 1 after a rollback of one token
    c = eng.forward(torch.tensor([seq[-1:]]))
    assert _rel(c.logits[0, 0], ref[-1]) <= 1e-5


def test_rope_equals_hf_rotate_half():
    from dflash_pipe.target.small_batch_ops import rope, signed_sin
    from transformers.models.llama.modeling_llama import rotate_half  # HF's own: the reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 5, 64, generator=g).transpose(1, 2)          # [B, H, T, D] strided, as the engine's q / k
    ang = torch.randn(2, 1, 7, 64, generator=g)
    cos, sin = ang.cos(), ang.sin()
    want = x.double() * cos.double() + rotate_half(x.double()) * sin.double()
    got = rope(x, cos, signed_sin(sin))
    assert float((got.double() - want).abs().max()) < 1e-6


def test_linear_choice_skips_broken_and_inexact_candidates_and_keeps_to_the_copy_budget(monkeypatch):
    from dflash_pipe.target import linear_choice as lc

    real = lc.CANDIDATES
    calls = {"boom": 0}

    def boom(x, W, b, extra):
        calls["boom"] += 1
        raise RuntimeError("no such kernel here")

    def wrong(x, W, b, extra):
        return torch.nn.functional.linear(x, W, b) * 1.01          # fast and wrong

    cands = {"linear": real["linear"], "boom": (boom, lambda *a: True, False),
             "wrong": (wrong, lambda *a: True, False), "split_k4": real["split_k4"], "mm_t": real["mm_t"],
             "w_x": real["w_x"]}
    fake_us = {"linear": 10.0, "boom": 1.0, "wrong": 1.0, "split_k4": 6.0, "mm_t": 4.0, "w_x": 9.8}
    monkeypatch.setattr(lc, "CANDIDATES", cands)
    monkeypatch.setattr(lc, "_graph_time_us", lambda fn, *a: next(fake_us[n] for n, c in cands.items() if c[0] is fn))
    monkeypatch.setattr(lc, "_CACHE", {})
    W = torch.randn(64, 32)
    ch = lc.LinearChooser(torch.device("cpu"))
    ch.device = torch.device("cuda")                                 # as if on a GPU (timing is faked)
    assert ch.choose(W, None, 16, copies=4) == "mm_t"                 # fastest exact one; its copies fit
    assert calls["boom"] == 1 and set(ch.table[next(iter(ch.table))][1]) == {"linear", "split_k4", "mm_t", "w_x"}
    assert ch.copy_bytes == 4 * W.numel() * 4
    tight = lc.LinearChooser(torch.device("cpu"), max_copy_bytes=W.numel() * 4)
    tight.device = torch.device("cuda")
    assert tight.choose(W, None, 16, copies=4) == "split_k4" and tight.copy_bytes == 0   # the copy does not fit
    del cands["split_k4"], cands["mm_t"]
    monkeypatch.setattr(lc, "_CACHE", {})
    assert ch.choose(W, None, 16) == "linear"                        # w_x is within MIN_GAIN of F.linear


def test_an_engine_built_in_inference_mode_leaves_trainable_parameters():
    model = _model("tiny-llama").requires_grad_(True)
    with torch.inference_mode():
        StaticKVEngine(model, max_batch=1, max_len=16)
    q = model.model.layers[0].self_attn.q_proj.weight
    attn = model.model.layers[0].self_attn
    assert q.requires_grad and not q.is_inference() and q.data_ptr() == attn.q_proj._dflash_fused[0].data_ptr()
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()    # the HF model still trains
    assert q.grad is not None and q.grad.abs().sum() > 0
