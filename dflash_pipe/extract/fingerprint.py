"""The cache fingerprint: a hash of everything that determines the features, and nothing else.

In: target weights/config/tokenizer/chat template identity, compute dtype, the data selection,
layer ids and their convention, max length, feature codec, top-k and shard count.
Out: anything about the drafter or training, the packing budget (packing is exact, so it does
not change features), worker counts, paths. Changing a drafter or training setting therefore
never invalidates a cache.
"""

from __future__ import annotations

import torch

from ..cache.manifest import LAYER_CONVENTION
from ..cache.schema import FORMAT_VERSION
from ..config import RunConfig


def resolve_target_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]


def fingerprint_fields(cfg: RunConfig, identity: dict, layer_ids: list[int], dataset_fingerprint: str,
                       dtype: torch.dtype) -> dict:
    ex = cfg.extract
    return {
        "format_version": FORMAT_VERSION,
        # a local directory is identified by its weights/config hashes, not by where it lives
        "target_model": spec if (spec := identity.get("model_id", cfg.target.model)).startswith(
            ("embedded:", "random:")) else "local-directory",
        "target_revision": cfg.target.revision,
        "weights_fingerprint": identity.get("weights_fingerprint"),
        "config_hash": identity.get("config_hash"),
        "tokenizer_hash": identity.get("tokenizer_hash"),
        "chat_template_hash": identity.get("chat_template_hash"),
        "target_dtype": str(dtype).replace("torch.", ""),
        "dataset_fingerprint": dataset_fingerprint,
        "layer_ids": list(layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "max_length": ex.max_length,
        "feature_dtype": "bfloat16",
        "codec": ex.codec,
        "topk": ex.topk,
        "num_shards": ex.num_shards,
    }
