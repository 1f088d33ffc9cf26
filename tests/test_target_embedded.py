"""The embedded SmolLM2 target: GGUF -> safetensors conversion once, reused, crash-safe.

One conversion (~15 s: transformers dequantizes the GGUF in Python) and one direct GGUF load
as the reference; marked slow, still part of the CI suite.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash_pipe.target import embedded as embedded_mod
from dflash_pipe.target import load_target, read_embeddings_and_head
from dflash_pipe.target.embedded import CONVERSION_MARKER, embedded_gguf_path

pytestmark = pytest.mark.slow

SPEC = "embedded:smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is speculative decoding, in one sentence?"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("embedded-cache")
    # A killed earlier conversion: a temp dir of a dead process, and a final dir without marker.
    stale = cache / ".smollm2-135m-instruct.tmp-999999999-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    partial = cache / "smollm2-135m-instruct"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (partial / "model.safetensors").write_bytes(b"\0" * 64)
    bundle = load_target(SPEC, dtype="float32", model_cache_dir=cache)
    return cache, bundle


def test_conversion_matches_direct_gguf_load(converted):
    cache, bundle = converted
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path("smollm2-135m-instruct")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    ids = bundle.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    with torch.inference_mode():
        ref = direct(input_ids=ids).logits
        got = bundle.model(input_ids=ids).logits
    assert torch.equal(got, ref)
    assert bundle.model_dir == cache / "smollm2-135m-instruct"
    assert bundle.family == "llama" and bundle.num_layers == 30 and bundle.hidden_size == 576
    assert bundle.tokenizer.chat_template and "<|im_start|>" in bundle.tokenizer.chat_template
    # tied embeddings: the head read from the converted dir is the GGUF's token embedding
    embed, head, _ = read_embeddings_and_head(bundle.model_dir)
    assert head is embed and torch.equal(embed, direct.get_input_embeddings().weight)


def test_partial_leftovers_were_not_used(converted):
    cache, bundle = converted
    final = cache / "smollm2-135m-instruct"
    marker = json.loads((final / CONVERSION_MARKER).read_text())
    assert marker["kind"] == "model" and "model.safetensors" in marker["files"]
    assert (final / "model.safetensors").stat().st_size == marker["files"]["model.safetensors"] > 10 ** 8
    assert not (cache / ".smollm2-135m-instruct.tmp-999999999-dead").exists()
    assert not [p for p in os.listdir(cache) if ".tmp-" in p]


def test_second_load_reuses_the_converted_dir(converted, monkeypatch):
    cache, bundle = converted

    def no_gguf(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(embedded_mod, "_write_dequantized_model", no_gguf)
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def guarded(path, *a, **k):
        assert "gguf_file" not in k, "the tokenizer was converted again"
        return real(path, *a, **k)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", guarded)
    again = load_target(SPEC, dtype="float32", model_cache_dir=cache)
    assert again.identity["weights_fingerprint"] == bundle.identity["weights_fingerprint"]
    assert again.identity["config_hash"] == bundle.identity["config_hash"]
    # random presets take their tokenizer from the full converted dir when it exists
    rnd = load_target("random:tiny-llama", dtype="float32", model_cache_dir=cache)
    assert rnd.identity["tokenizer_hash"] == bundle.identity["tokenizer_hash"]
    assert not (cache / "smollm2-135m-instruct-tokenizer").exists()


def test_damaged_conversion_is_detected(converted, tmp_path):
    cache, bundle = converted
    final = cache / "smollm2-135m-instruct"
    # truncate the tokenizer file: size no longer matches the marker -> incomplete -> converted again
    tok = final / "tokenizer.json"
    size = tok.stat().st_size
    with open(tok, "r+b") as f:
        f.truncate(size // 2)
    from dflash_pipe.target.embedded import conversion_is_complete
    from dflash_pipe.target.fingerprint import file_sample_digest

    digest = file_sample_digest(embedded_gguf_path("smollm2-135m-instruct"))
    assert not conversion_is_complete(final, digest, "model")
    # only the tokenizer is re-extracted for a random preset in a fresh cache pointing at nothing
    tok_only = embedded_mod.ensure_embedded_tokenizer_dir(tmp_path)
    assert tok_only.name == "smollm2-135m-instruct-tokenizer"
    assert conversion_is_complete(tok_only, digest, "tokenizer")
    assert not (tok_only / "model.safetensors").exists()


@pytest.mark.parametrize("complete_first", [True, False])
def test_a_second_finished_conversion_never_replaces_a_complete_one(tmp_path, complete_first):
    """Processes converting at once (three eval jobs on a fresh machine, quality driver): the one that finishes
    second keeps the first one's directory, which the others may already be reading, instead of moving it aside.
    An incomplete leftover is still replaced."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"gguf")
    final = tmp_path / "smollm2-135m-instruct"

    def staged(tag: str):
        tmp = tmp_path / f".smollm2-135m-instruct.tmp-{tag}"
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps({"tag": tag}))
        return tmp

    if complete_first:
        embedded_mod._finish_conversion(staged("first"), final, source, "d1", "model")
    else:
        final.mkdir()
        (final / "config.json").write_text("{}")           # a killed conversion's leftover: no marker
    inode = final.stat().st_ino
    second = staged("second")
    embedded_mod._finish_conversion(second, final, source, "d1", "model")
    assert not second.exists()
    assert embedded_mod.conversion_is_complete(final, "d1", "model")
    kept = json.loads((final / "config.json").read_text())
    if complete_first:
        assert final.stat().st_ino == inode and kept == {"tag": "first"}
    else:
        assert kept == {"tag": "second"}
