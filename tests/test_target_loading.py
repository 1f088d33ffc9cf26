"""Loading targets: presets, determinism, provenance, local directories, embeddings/head readers."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from dflash_pipe.errors import CacheError, UsageError, ValidationError
from dflash_pipe.target import (
    load_target,
    preset_config,
    read_embeddings_and_head,
    save_embeddings_and_head,
    weights_fingerprint_files,
)
from dflash_pipe.target.fingerprint import SAMPLE_BYTES, read_safetensors_header, tokenizer_hash
from dflash_pipe.target.loading import build_random_model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "dflash-model-cache"


@pytest.fixture(scope="module")
def qwen(cache_dir):
    return load_target("random:tiny-qwen3.5", dtype="float32", model_cache_dir=cache_dir)


@pytest.fixture(scope="module")
def llama(cache_dir):
    return load_target("random:tiny-llama", dtype="float32", model_cache_dir=cache_dir)


def test_random_preset_is_deterministic_and_seeded(qwen, cache_dir):
    again = load_target("random:tiny-qwen3.5", dtype="float32", model_cache_dir=cache_dir)
    other = load_target("random:tiny-qwen3.5", dtype="float32", seed=1, model_cache_dir=cache_dir)
    a, b, c = (dict(x.model.named_parameters()) for x in (qwen, again, other))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
    assert qwen.identity == again.identity
    assert qwen.identity["weights_fingerprint"] != other.identity["weights_fingerprint"]
    assert qwen.identity["config_hash"] == other.identity["config_hash"]
    # the caller's RNG state is not consumed by building a seeded model
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    build_random_model("tiny-llama", seed=5, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(torch.rand(3), expect)


def test_bundle_fields(qwen, llama):
    assert qwen.family == "qwen3.5" and llama.family == "llama"
    assert (qwen.num_layers, qwen.hidden_size, qwen.vocab_size) == (8, 64, 49152)
    assert qwen.model_dir is None
    assert type(qwen.model).__name__ == "Qwen3_5ForCausalLM"
    assert qwen.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    for key in ("model", "revision", "architecture", "weights_fingerprint", "config_hash", "tokenizer_hash",
                "chat_template_hash"):
        assert key in qwen.identity
    assert qwen.identity["chat_template_hash"] is not None        # SmolLM2's chat template
    assert qwen.identity["tokenizer_hash"] == llama.identity["tokenizer_hash"] == tokenizer_hash(qwen.tokenizer)
    assert qwen.tokenizer.chat_template and len(qwen.tokenizer) == 49152
    assert not any(p.requires_grad for p in qwen.model.parameters()) and not qwen.model.training


def test_27b_shape_preset_config():
    c = preset_config("qwen3.5-27b-shape")
    assert type(c).__name__ == "Qwen3_5TextConfig"
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.intermediate_size) == (64, 5120, 248320, 17408)
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 48)
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (128, 128, 4)
    assert c.rope_parameters["rope_theta"] == 1e7 and c.rope_parameters["partial_rotary_factor"] == 0.25
    assert c.tie_word_embeddings is False
    # parameter count on the meta device (no memory): the published model has ~27B (text part)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    assert 26.5e9 < n < 27.5e9


def test_unknown_specs_are_refused(cache_dir, tmp_path):
    with pytest.raises(UsageError, match="preset"):
        load_target("random:nope", model_cache_dir=cache_dir)
    with pytest.raises(UsageError, match="embedded"):
        load_target("embedded:nope", model_cache_dir=cache_dir)
    with pytest.raises(UsageError, match="not a local directory"):
        load_target("Qwen/Qwen3.5-27B", model_cache_dir=cache_dir)       # never fetched from the hub
    with pytest.raises(UsageError, match="attn_implementation"):
        load_target("random:tiny-llama", model_cache_dir=cache_dir, attn_implementation="flex_attention")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ValidationError, match="pickle"):
        load_target(str(tmp_path), model_cache_dir=cache_dir)


def _save_dir(bundle, path):
    bundle.model.save_pretrained(str(path))
    bundle.tokenizer.save_pretrained(str(path))
    return path


def test_local_directory_round_trip(qwen, tmp_path):
    d = _save_dir(qwen, tmp_path / "m")
    loaded = load_target(str(d), dtype="float32")
    a, b = dict(qwen.model.named_parameters()), dict(loaded.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert loaded.model_dir == d.resolve()
    assert loaded.identity["tokenizer_hash"] == qwen.identity["tokenizer_hash"]
    assert loaded.identity["weights_fingerprint"] == weights_fingerprint_files(d.glob("*.safetensors"))
    assert loaded.family == "qwen3.5"


def _one_file_checkpoint(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_weights_fingerprint_detects_header_and_sampled_changes(tmp_path):
    torch.manual_seed(0)
    big = torch.randn(1024, 512)                     # 2 MiB: more data than the samples cover
    path = _one_file_checkpoint(tmp_path, {"a.weight": big, "b.weight": torch.randn(7)})
    fp = weights_fingerprint_files([path])
    assert fp == weights_fingerprint_files([path])   # deterministic
    n, _ = read_safetensors_header(path)
    data = bytearray(path.read_bytes())
    # a byte in the first sampled range (start of the data section) changes the hash
    flipped = bytearray(data)
    flipped[8 + n + 5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    assert weights_fingerprint_files([path]) != fp
    # the last bytes of the file are sampled too
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert weights_fingerprint_files([path]) != fp
    # a header change (here: a renamed tensor, same size) changes the hash
    renamed = bytes(data).replace(b'"b.weight"', b'"c.weight"', 1)
    path.write_bytes(renamed)
    assert weights_fingerprint_files([path]) != fp
    # the trade-off: a byte between sampled ranges is not seen (documented, ~1 MiB read per file)
    path.write_bytes(bytes(data))
    gap = 8 + n + SAMPLE_BYTES + 100
    flipped = bytearray(data)
    flipped[gap] ^= 0xFF
    path.write_bytes(bytes(flipped))
    assert weights_fingerprint_files([path]) == fp
    # truncated files are refused with a CacheError naming the file
    path.write_bytes(struct.pack("<Q", 10 ** 9) + b"{}")
    with pytest.raises(CacheError, match="model.safetensors"):
        weights_fingerprint_files([path])


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_read_embeddings_and_head_saved_dir(which, qwen, llama, tmp_path):
    bundle = qwen if which == "qwen" else llama
    d = _save_dir(bundle, tmp_path / which)
    embed, head, norm = read_embeddings_and_head(d)
    model = bundle.model
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    tied = which == "llama"
    assert (head is embed) == tied
    assert not torch.equal(head, embed) or tied
    stored = model.base_model.norm.weight
    # Qwen3.5's RMSNorm multiplies by (1 + w); Llama's by w. The reader returns the effective scale.
    expect = (1.0 + stored.float()) if which == "qwen" else stored
    assert torch.equal(norm, expect)


@pytest.mark.parametrize("form", ["target_head.safetensors", "head_dir"])
@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_save_embeddings_and_head_round_trip(which, form, qwen, llama, tmp_path):
    bundle = qwen if which == "qwen" else llama
    out = save_embeddings_and_head(bundle, tmp_path / form)
    assert out.is_file() == form.endswith(".safetensors")
    embed, head, norm = read_embeddings_and_head(out)
    assert torch.equal(embed, bundle.model.get_input_embeddings().weight)
    assert torch.equal(head, bundle.model.get_output_embeddings().weight)
    assert (head is embed) == (which == "llama")
    ref = read_embeddings_and_head(_save_dir(bundle, tmp_path / "full")).final_norm_scale_H
    assert torch.equal(norm, ref)
    if out.is_dir():
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] == (which == "llama")
        assert cfg["weights_fingerprint"] == bundle.identity["weights_fingerprint"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]     # atomic writes left no temp


def test_head_file_without_metadata_is_refused(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(3, 2)}, str(path))
    with pytest.raises(CacheError, match="dflash_config"):
        read_embeddings_and_head(path)


def test_read_embeddings_sharded_vlm_layout(tmp_path):
    """Sharded checkpoint with an index and Qwen3.5's `model.language_model.` prefix; only 3 tensors read."""
    torch.manual_seed(0)
    embed, head, norm = torch.randn(11, 4), torch.randn(11, 4), torch.randn(4)
    shards = {
        "model-00001-of-00002.safetensors": {"model.language_model.embed_tokens.weight": embed,
                                             "model.language_model.layers.0.mlp.up_proj.weight": torch.randn(8, 4)},
        "model-00002-of-00002.safetensors": {"lm_head.weight": head, "model.language_model.norm.weight": norm,
                                             "mtp.norm.weight": torch.randn(4)},
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(tmp_path / fname))
        weight_map.update({k: fname for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "tie_word_embeddings": False,
                                                      "text_config": {"model_type": "qwen3_5_text",
                                                                      "tie_word_embeddings": False}}))
    e, h, n = read_embeddings_and_head(tmp_path)
    assert torch.equal(e, embed) and torch.equal(h, head) and torch.equal(n, 1.0 + norm)
    # a shard listed in the index but missing is reported by name
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CacheError, match="model-00002-of-00002"):
        read_embeddings_and_head(tmp_path)


def test_read_embeddings_untied_without_head_is_an_error(tmp_path):
    save_file({"model.embed_tokens.weight": torch.randn(5, 3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    with pytest.raises(CacheError, match="lm_head"):
        read_embeddings_and_head(tmp_path)


def test_random_target_without_tokenizer(cache_dir, qwen):
    bare = load_target("random:tiny-qwen3.5", dtype="float32", model_cache_dir=cache_dir, with_tokenizer=False)
    assert bare.tokenizer is None
    assert bare.identity["tokenizer_hash"] is None and bare.identity["chat_template_hash"] is None
    assert bare.identity["weights_fingerprint"] == qwen.identity["weights_fingerprint"]


def test_tensor_sample_addresses_huge_tensors_exactly():
    """Sample indices are integer math: float32 cannot address element 2**25 + 2 (regression: the
    27B head has 1.27e9 elements and a float linspace indexed past its end on the GPU)."""
    from dflash_pipe.target.fingerprint import TENSOR_SAMPLES, _tensor_sample

    t = torch.zeros(2 ** 25 + 3, dtype=torch.uint8)
    t[-1] = 7
    t[(t.numel() - 1) // (TENSOR_SAMPLES - 1)] = 3
    s = _tensor_sample(t)
    assert s.numel() == TENSOR_SAMPLES and int(s[-1]) == 7 and int(s[1]) == 3 and int(s[0]) == 0


def test_the_embedded_tokenizer_dir_expands_a_home_relative_cache_dir(tmp_path, monkeypatch):
    """The default model cache dir is "~/.cache/...": called directly (bench scripts do), the helper used to create a
    literal "~" directory in the working directory."""
    from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    got = ensure_embedded_tokenizer_dir("~/models")
    assert str(got).startswith(str(tmp_path / "home" / "models")) and got.is_dir()
    assert not (tmp_path / "~").exists()
