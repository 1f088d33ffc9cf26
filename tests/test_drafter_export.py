"""Export writes exactly the SPEC §9 names/keys, round-trips bit-exactly, and reads back in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_pipe.drafter.export import export_drafter, load_exported_drafter
from dflash_pipe.drafter.masks import AttentionMask
from dflash_pipe.drafter.model import DFlashDrafter
from dflash_pipe.errors import CacheError, ValidationError
from tests.test_drafter_support import random_packed_row, randomize_, tiny_config

SPEC_KEYS = {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "layer_types",
             "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "rope_theta", "vocab_size", "tie_word_embeddings", "num_hidden_layers", "torch_dtype"}


def spec_tensor_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in ("q", "k")}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    return names


@pytest.fixture()
def exported(tmp_path):
    cfg = tiny_config(num_layers=3, mask_token_id=61, rope_theta=1e6)
    model = DFlashDrafter(cfg)
    randomize_(model, 11)
    out = export_drafter(model, cfg, tmp_path / "export")
    return model, cfg, out


def test_files_names_dtypes_and_config_keys(exported):
    model, cfg, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names == spec_tensor_names(3)
    conf = json.loads((out / "config.json").read_text())
    assert SPEC_KEYS <= set(conf)
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["block_size"] == conf["dflash_config"]["block_size"] == cfg.block_size
    assert conf["dflash_config"]["mask_token_id"] == 61
    assert conf["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert conf["layer_types"] == ["full_attention"] * 3 and conf["num_hidden_layers"] == 3
    assert conf["tie_word_embeddings"] is False and conf["torch_dtype"] == "bfloat16"
    assert conf["rope_theta"] == conf["rope_parameters"]["rope_theta"] == 1e6
    assert conf["num_target_layers"] == cfg.num_target_layers


def test_round_trip_is_bit_exact(exported):
    model, cfg, out = exported
    stored = load_file(str(out / "model.safetensors"))
    for dtype in (torch.bfloat16, torch.float32):
        loaded, cfg2 = load_exported_drafter(out, dtype=dtype)
        assert cfg2 == cfg
        for name, t in loaded.state_dict().items():
            assert t.dtype == dtype
            assert torch.equal(t.to(torch.bfloat16), stored[name])
            assert torch.equal(t, stored[name].to(dtype))  # bf16 -> fp32 is exact
    # exporting the loaded model again gives byte-identical tensors
    again = load_file(str(export_drafter(loaded, cfg2, out.parent / "again") / "model.safetensors"))
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)


def test_transformers_reads_the_config_and_a_z_lab_style_forward_matches(exported):
    """Rebuild one block's forward the way z-lab's DFlashDraftModel does it, from transformers' Qwen3
    modules configured by our config.json, and compare with the packed drafter forward."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    _, cfg, out = exported
    hf = Qwen3Config.from_pretrained(str(out))
    assert (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers) == (8, 4, 2, 3)
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.tie_word_embeddings is False
    model, _ = load_exported_drafter(out, dtype=torch.float32)
    sd = {k: v.float() for k, v in model.state_dict().items()}

    def norm(name, dim):
        m = Qwen3RMSNorm(dim, eps=hf.rms_norm_eps)
        m.weight.data.copy_(sd[name])
        return m

    def mlp(i):
        m = Qwen3MLP(hf)
        for p in ("gate", "up", "down"):
            getattr(m, f"{p}_proj").weight.data.copy_(sd[f"layers.{i}.mlp.{p}_proj.weight"])
        return m

    row = random_packed_row(8, doc_lens=(7, 12), pad_ctx=2, blocks_per_doc=3, pad_blocks=1, block_size=cfg.block_size)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(row.S, 3 * cfg.hidden_size, generator=g)
    embeds = torch.randn(row.N * cfg.block_size, cfg.hidden_size, generator=g)
    mask = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size)
    with torch.no_grad():
        packed = model(feats, embeds, row.ctx_pos, row.block_pos(), mask)
        rot = Qwen3RotaryEmbedding(hf)
        B, D = cfg.block_size, cfg.head_dim
        for j in range(row.N - 1):  # the valid blocks
            a = int(row.anchor_index[j])
            doc = int(row.block_doc[j])
            ctx = [c for c in range(a) if int(row.ctx_doc[c]) == doc]
            target_hidden = feats[ctx][None] @ sd["fc.weight"].T
            target_hidden = norm("hidden_norm.weight", cfg.hidden_size)(target_hidden)
            hs = embeds[j * B:(j + 1) * B][None]
            pos = torch.cat([row.ctx_pos[ctx], row.block_pos()[j * B:(j + 1) * B]])[None]
            cos, sin = rot(hs, pos)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            for i in range(cfg.num_layers):
                w = lambda n: sd[f"layers.{i}.self_attn.{n}.weight"]
                res = hs
                hs = norm(f"layers.{i}.input_layernorm.weight", cfg.hidden_size)(hs)
                q = norm(f"layers.{i}.self_attn.q_norm.weight", D)((hs @ w("q_proj").T).view(1, B, -1, D)).transpose(1, 2)
                k = torch.cat([target_hidden @ w("k_proj").T, hs @ w("k_proj").T], dim=1).view(1, len(ctx) + B, -1, D)
                v = torch.cat([target_hidden @ w("v_proj").T, hs @ w("v_proj").T], dim=1).view(1, len(ctx) + B, -1, D)
                k = norm(f"layers.{i}.self_attn.k_norm.weight", D)(k).transpose(1, 2)
                v = v.transpose(1, 2)
                q = q * cos[..., -B:, :] + rotate_half(q) * sin[..., -B:, :]
                k = k * cos + rotate_half(k) * sin
                att = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                hs = res + att.transpose(1, 2).reshape(1, B, -1) @ w("o_proj").T
                hs = hs + mlp(i)(norm(f"layers.{i}.post_attention_layernorm.weight", cfg.hidden_size)(hs))
            ref = norm("norm.weight", cfg.hidden_size)(hs)[0]
            torch.testing.assert_close(packed[j * B:(j + 1) * B], ref, rtol=1e-4, atol=1e-4)


def test_damaged_exports_are_refused(exported, tmp_path):
    _, cfg, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((out / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CacheError, match="norm.weight"):
        load_exported_drafter(bad)
    save_file(dict(tensors, **{"lm_head.weight": torch.zeros(2, 2)}), str(bad / "model.safetensors"))
    with pytest.raises(CacheError, match="lm_head.weight"):
        load_exported_drafter(bad)
    save_file(dict(tensors, **{"fc.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}), str(bad / "model.safetensors"))
    with pytest.raises(CacheError, match="fc.weight has shape"):
        load_exported_drafter(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(CacheError, match="cannot read"):
        load_exported_drafter(bad)
    conf = json.loads((out / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(conf, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValidationError, match="DFlashDraftModel"):
        load_exported_drafter(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CacheError, match="not valid JSON"):
        load_exported_drafter(bad)
    with pytest.raises(CacheError, match="needs config.json"):
        load_exported_drafter(tmp_path / "nowhere")


def test_wrapped_models_export_under_the_plain_names(exported, tmp_path):
    model, cfg, out = exported

    class FakeDDP(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    wrapped = FakeDDP(torch.compile(model))  # compiling is lazy: nothing is compiled here
    names = set(load_file(str(export_drafter(wrapped, cfg, tmp_path / "w") / "model.safetensors")))
    assert names == spec_tensor_names(cfg.num_layers)
    # the trainer compiles every draft layer on its own (train/components.py build_model)
    per_layer = DFlashDrafter(cfg)
    per_layer.load_state_dict(model.state_dict())
    for i, layer in enumerate(per_layer.layers):
        per_layer.layers[i] = torch.compile(layer, dynamic=False)
    assert any("_orig_mod" in k for k in per_layer.state_dict())
    got = load_file(str(export_drafter(per_layer, cfg, tmp_path / "layers") / "model.safetensors"))
    want = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValidationError, match="expected a DFlashDrafter"):
        export_drafter(torch.nn.Linear(2, 2), cfg, tmp_path / "x")
    with pytest.raises(ValidationError, match="do not match the config"):
        export_drafter(model, tiny_config(num_layers=2), tmp_path / "y")
