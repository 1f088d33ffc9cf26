"""The packed drafter forward equals an independent per-block recomputation (float64).

For every block the reference runs the layers on just that block and the context it may see
(same document, position before the anchor), with unmasked attention, written from SPEC §4 and
z-lab's DFlash attention: context K/V from hidden_norm(fc(features)) without input_layernorm.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_pipe.drafter.masks import AttentionMask
from dflash_pipe.drafter.model import DFlashDrafter
from dflash_pipe.errors import ValidationError
from tests.test_drafter_support import random_packed_row, randomize_, tiny_config


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x_THD, pos_T, theta):
    """Rotate pairs (i, i + d/2) by pos * theta^(-2i/d), one angle at a time."""
    d = x_THD.shape[-1]
    out = torch.empty_like(x_THD)
    for t in range(x_THD.shape[0]):
        for i in range(d // 2):
            ang = float(pos_T[t]) * theta ** (-2.0 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x_THD[t, :, i], x_THD[t, :, i + d // 2]
            out[t, :, i] = a * c - b * s
            out[t, :, i + d // 2] = b * c + a * s
    return out


def reference_block(sd, cfg, feats_sF, ctx_pos_s, embeds_BH, pos_B, norm_context=False):
    eps, hq, hkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = _rms(feats_sF @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = embeds_BH.clone()
    for i in range(cfg.num_layers):
        p = lambda n: sd[f"layers.{i}.{n}"]
        xn = _rms(x, p("input_layernorm.weight"), eps)
        ctx_in = _rms(h, p("input_layernorm.weight"), eps) if norm_context else h
        q = _rope(_rms((xn @ p("self_attn.q_proj.weight").T).view(-1, hq, d), p("self_attn.q_norm.weight"), eps),
                  pos_B, cfg.rope_theta)
        kc = _rope(_rms((ctx_in @ p("self_attn.k_proj.weight").T).view(-1, hkv, d), p("self_attn.k_norm.weight"), eps),
                   ctx_pos_s, cfg.rope_theta)
        kb = _rope(_rms((xn @ p("self_attn.k_proj.weight").T).view(-1, hkv, d), p("self_attn.k_norm.weight"), eps),
                   pos_B, cfg.rope_theta)
        vc = (ctx_in @ p("self_attn.v_proj.weight").T).view(-1, hkv, d)
        vb = (xn @ p("self_attn.v_proj.weight").T).view(-1, hkv, d)
        keys, vals = torch.cat([kc, kb]), torch.cat([vc, vb])
        heads = []
        for head in range(hq):
            kv_head = head // (hq // hkv)
            scores = q[:, head] @ keys[:, kv_head].T / math.sqrt(d)
            heads.append(torch.softmax(scores, dim=-1) @ vals[:, kv_head])
        x = x + torch.cat(heads, dim=-1) @ p("self_attn.o_proj.weight").T
        xn2 = _rms(x, p("post_attention_layernorm.weight"), eps)
        gate, up = xn2 @ p("mlp.gate_proj.weight").T, xn2 @ p("mlp.up_proj.weight").T
        x = x + (gate * torch.sigmoid(gate) * up) @ p("mlp.down_proj.weight").T
    return _rms(x, sd["norm.weight"], eps)


def build(cfg, seed=0, **kw):
    model = DFlashDrafter(cfg, **kw).double()
    randomize_(model, seed)
    return model


def inputs(row, cfg, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(row.S, cfg.num_target_features * cfg.hidden_size, generator=g, dtype=torch.float64)
    embeds = torch.randn(row.N * row.block_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    mask = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size)
    return feats.to(dtype), embeds.to(dtype), row.ctx_pos, row.block_pos(), mask


def per_block_reference(model, cfg, row, feats, embeds, norm_context=False):
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    B = row.block_size
    outs = []
    for j in range(row.N):
        rows = []
        if bool(row.block_valid[j]):
            doc, anchor_pos = int(row.block_doc[j]), int(row.ctx_pos[row.anchor_index[j]])
            rows = [c for c in range(row.S) if int(row.ctx_doc[c]) == doc and int(row.ctx_pos[c]) < anchor_pos]
        rows = torch.tensor(rows, dtype=torch.int64)
        outs.append(reference_block(sd, cfg, feats[rows], row.ctx_pos[rows], embeds[j * B:(j + 1) * B],
                                    row.block_pos()[j * B:(j + 1) * B], norm_context))
    return torch.cat(outs)


ROW_KW = [dict(seed=0), dict(seed=1, doc_lens=(3, 12, 7, 1), pad_ctx=0, blocks_per_doc=3, pad_blocks=3)]


@pytest.mark.parametrize("kw", ROW_KW)
def test_packed_forward_equals_per_block_reference(kw):
    cfg = tiny_config()
    row = random_packed_row(**kw, block_size=cfg.block_size)
    model = build(cfg)
    feats, embeds, cpos, bpos, mask = inputs(row, cfg)
    with torch.no_grad():
        out = model(feats, embeds, cpos, bpos, mask)
        ref = per_block_reference(model, cfg, row, feats, embeds)
    assert out.shape == (row.N * cfg.block_size, cfg.hidden_size)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # The reference is sensitive to the one modelling choice that is easy to get wrong: putting the
    # context through input_layernorm too changes the output far beyond the tolerance above.
    with torch.no_grad():
        wrong = per_block_reference(model, cfg, row, feats, embeds, norm_context=True)
    valid_rows = row.block_valid.repeat_interleave(cfg.block_size)
    has_ctx = torch.tensor([bool(row.block_valid[j]) and int(row.ctx_pos[row.anchor_index[j]]) > 0
                            for j in range(row.N)]).repeat_interleave(cfg.block_size)
    assert (out[has_ctx & valid_rows] - wrong[has_ctx & valid_rows]).abs().max() > 1e-3


def test_flex_path_equals_sdpa_path_in_float64():
    cfg = tiny_config(num_layers=3)
    row = random_packed_row(2, doc_lens=(10, 8, 15), pad_ctx=2, blocks_per_doc=4, pad_blocks=1)
    sdpa = build(cfg, seed=4, attention="sdpa")
    flex = build(cfg, seed=4, attention="flex", flex_compiled=False, flex_dtype=None)
    feats, embeds, cpos, bpos, mask = inputs(row, cfg, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(flex(feats, embeds, cpos, bpos, mask), sdpa(feats, embeds, cpos, bpos, mask),
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["layer", "mlp"])
def test_gradient_checkpointing_gives_the_same_gradients(mode):
    cfg = tiny_config()
    row = random_packed_row(3)
    feats, embeds, cpos, bpos, mask = inputs(row, cfg, seed=2)
    grads = []
    for ckpt in (False, True):
        model = build(cfg, seed=5, gradient_checkpointing=ckpt and mode == "layer")
        for layer in model.layers:
            layer.checkpoint_mlp = ckpt and mode == "mlp"
        e = embeds.clone().requires_grad_()
        out = model(feats, e, cpos, bpos, mask)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([e.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bf16_features_are_used_as_given_and_autocast_stays_close():
    cfg = tiny_config()
    row = random_packed_row(4)
    model = DFlashDrafter(cfg)  # fp32 master weights
    randomize_(model, 6, std=0.2)
    feats, embeds, cpos, bpos, mask = inputs(row, cfg, seed=3, dtype=torch.float32)
    feats_bf16 = feats.to(torch.bfloat16)
    with torch.no_grad():
        from_bf16 = model(feats_bf16, embeds, cpos, bpos, mask)
        from_f32_of_bf16 = model(feats_bf16.float(), embeds, cpos, bpos, mask)
        torch.testing.assert_close(from_bf16, from_f32_of_bf16, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(feats_bf16, embeds, cpos, bpos, mask)
    assert mixed.dtype == torch.float32 and torch.isfinite(mixed).all()
    rel = (mixed - from_bf16).norm() / from_bf16.norm()
    assert rel < 5e-2


def test_parameter_names_are_the_z_lab_ones():
    cfg = tiny_config(num_layers=2)
    names = set(DFlashDrafter(cfg).state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert names == expected
    sd = DFlashDrafter(cfg).state_dict()
    assert sd["fc.weight"].shape == (32, 3 * 32)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 32)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)


def test_mismatched_inputs_are_refused():
    cfg = tiny_config()
    row = random_packed_row(0)
    model = build(cfg)
    feats, embeds, cpos, bpos, mask = inputs(row, cfg)
    with pytest.raises(ValidationError, match="target_hidden_SF"):
        model(feats[:, :-1], embeds, cpos, bpos, mask)
    with pytest.raises(ValidationError, match="mask"):
        model(feats[:-1], embeds, cpos[:-1], bpos, mask)
