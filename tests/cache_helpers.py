"""Build small synthetic caches for tests (no target model needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_pipe.cache import (encode_hidden, init_or_check_spec, make_spec, shard_name, try_finalize,
                               write_sidecar)
from dflash_pipe.cache.schema import shard_meta
from dflash_pipe.cache.writer import ShardWriter, make_row


def heavy_tailed(T: int, D: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) / torch.rand(T, D, generator=g).clamp_min(0.05) ** 0.5
    x[:, 3] *= 300.0  # a massive-activation channel, as real residual streams have
    return x.to(torch.bfloat16)


def make_docs(num_docs: int, width: int, seed: int = 0, topk: int = 4, min_len: int = 5, max_len: int = 40,
              vocab: int = 1000):
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(num_docs):
        T = int(rng.integers(min_len, max_len))
        ids = rng.integers(0, vocab, size=T).astype(np.int32)
        mask = (rng.random(T) < 0.7).astype(np.uint8)
        hidden = heavy_tailed(T, width, seed * 1000 + i)
        tk_ids = torch.from_numpy(rng.integers(0, vocab, size=(T, topk)).astype(np.int32)) if topk else None
        tk_lp = (-torch.rand(T, topk) * 10).to(torch.float16) if topk else None
        docs.append(dict(sample_id=f"s{i}", doc_index=i, input_ids=ids, loss_mask=mask, hidden=hidden,
                         topk_ids=tk_ids, topk_logprobs=tk_lp))
    return docs


def fields_for(width: int, num_layers: int, codec: str, topk: int, tag: str = "t") -> dict:
    return {"target": tag, "width": width, "num_layers": num_layers, "codec": codec, "topk": topk}


def write_cache(cache_dir: Path, docs, width: int, num_layers: int, codec: str = "lossless", topk: int = 4,
                num_shards: int = 2, row_group_bytes: int = 2000, fingerprint_fields: dict | None = None,
                finalize: bool = True, shard_of=None) -> dict:
    fields = fingerprint_fields or fields_for(width, num_layers, codec, topk)
    spec = make_spec(fields, target={"hidden_size": width // num_layers},
                     features={"width": width, "num_layers": num_layers, "codec": codec, "topk": topk,
                               "layer_ids": list(range(num_layers))},
                     num_shards=num_shards, extra={})
    init_or_check_spec(cache_dir, spec)
    for s in range(num_shards):
        w = ShardWriter(cache_dir, shard_name(s, num_shards), s, codec, topk,
                        shard_meta(codec, topk, width, num_layers, spec["fingerprint"]), row_group_bytes)
        mine = docs[s::num_shards] if shard_of is None else [d for i, d in enumerate(docs) if shard_of(i) == s]
        for d in mine:
            enc = encode_hidden(d["hidden"], codec, num_layers)
            w.add(make_row(d["sample_id"], d["doc_index"], d["input_ids"], d["loss_mask"], enc,
                           d["topk_ids"], d["topk_logprobs"]))
        info = w.commit()
        write_sidecar(cache_dir, spec, info, {"docs": info.rows})
    if finalize:
        try_finalize(cache_dir, spec)
    return spec


def write_train_cache(cache_dir: Path, num_docs: int = 24, hidden: int = 32, num_layers: int = 2, vocab: int = 97,
                      codec: str = "lossless", topk: int = 4, num_shards: int = 2, seed: int = 0,
                      max_len: int = 48, row_group_bytes: int = 4000, shard_of=None) -> dict:
    """A synthetic cache with everything stage 2 reads: spec with target config + head file."""
    from safetensors.torch import save_file

    from dflash_pipe.cache import load_spec
    from dflash_pipe.io_utils import atomic_write_json

    width = hidden * num_layers
    docs = make_docs(num_docs, width, seed=seed, topk=topk, min_len=8, max_len=max_len, vocab=vocab)
    for d in docs:
        d["hidden"] = (d["hidden"].float() / 30).to(torch.bfloat16)
    fields = fields_for(width, num_layers, codec, topk, f"synthetic-{seed}")
    write_cache(cache_dir, docs, width, num_layers, codec=codec, topk=topk, num_shards=num_shards,
                row_group_bytes=row_group_bytes, fingerprint_fields=fields, finalize=False, shard_of=shard_of)
    spec = load_spec(cache_dir)
    spec["target"] = {"family": "llama", "hidden_size": hidden, "vocab_size": vocab, "num_layers": 6,
                      "config": {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                                 "rope_theta": 10000.0}, "unused_embedding_row": [vocab - 1, "test"]}
    spec["features"] = {"layer_ids": [1, 4][:num_layers], "hidden_size": hidden, "num_layers": num_layers,
                        "width": width, "codec": codec, "topk": topk, "head_file": "target_head.safetensors",
                        "layer_convention": "test"}
    atomic_write_json(cache_dir / "cache_spec.json", spec)
    g = torch.Generator().manual_seed(seed)
    import json as _json

    save_file({"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "lm_head.weight": torch.randn(vocab, hidden, generator=g) * 0.2},
              str(cache_dir / "target_head.safetensors"),
              metadata={"dflash_config": _json.dumps({"model_type": "llama", "tie_word_embeddings": False,
                                                      "vocab_size": vocab, "hidden_size": hidden})})
    from dflash_pipe.cache import try_finalize
    try_finalize(cache_dir, spec)
    return spec


def fp8_reference(hidden_TD: torch.Tensor, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """The fp8 codec's quantisation computed independently: float64 arithmetic rounded once to float32 (exact for
    a single division of float32 operands), then e4m3 round-to-nearest-even by search over the 254 finite codes.
    Returns (quantised values as float64 [T, L, H], scale float32 [T, L])."""
    T, D = hidden_TD.shape
    x = hidden_TD.float().cpu().numpy().astype(np.float64).reshape(T, num_layers, D // num_layers)
    amax = np.abs(x).max(-1)
    scale = np.where(amax > 0, (amax / 448.0).astype(np.float32), np.float32(1))
    y = (x / scale.astype(np.float64)[..., None]).astype(np.float32).astype(np.float64).reshape(-1)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    keep = np.isfinite(codes)
    vals, idx = codes[keep], np.arange(256)[keep]
    order = np.argsort(vals, kind="stable")
    vals, idx = vals[order], idx[order]
    pos = np.searchsorted(vals, y).clip(1, len(vals) - 1)
    lo, hi = vals[pos - 1], vals[pos]
    up = (hi - y < y - lo) | ((hi - y == y - lo) & ((idx[pos] & 1) == 0))    # ties to the even code
    return np.where(up, hi, lo).reshape(T, num_layers, D // num_layers), scale


def tiny_train_config(cache_dir: Path, out_dir: Path, num_layers: int = 1, checkpoint_every: int = 0):
    """A normalized RunConfig training a tiny drafter (block 4, 96 context tokens, 8 anchors) on cache_dir."""
    from dflash_pipe.config import RunConfig, normalize

    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache_dir), str(out_dir)
    cfg.drafter.num_layers, cfg.drafter.block_size = num_layers, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.checkpoint_every = 96, 8, checkpoint_every
    return normalize(cfg)
