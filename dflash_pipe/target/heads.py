"""The target's token embedding, LM head and final norm, read without loading the model.

Stage 2 freezes the target's `embed_tokens` and `lm_head` inside the drafter (SPEC §4). For a
27B target those are two 248,320 x 5120 matrices out of 54 GB: `read_embeddings_and_head`
opens the safetensors files with `safe_open` and reads only those tensors, following
`model.safetensors.index.json` for sharded checkpoints.

Random targets have no checkpoint, so stage 1 writes one with `save_embeddings_and_head`: a
single safetensors file (its small config in the file metadata) or a minimal directory
(config.json + model.safetensors), with the same tensor names, that the same reader opens.

Naming: plain causal LMs store `model.embed_tokens.weight` / `lm_head.weight` /
`model.norm.weight`; Qwen3.5 checkpoints (a vision-language wrapper) store the text model
under `model.language_model.`. Tied embeddings (`tie_word_embeddings`, e.g. SmolLM2) have
no `lm_head.weight`: the head IS the embedding.

The final norm is returned as its effective multiplicative scale: Qwen3.5 / Qwen3-Next /
Gemma norms compute `x_hat * (1 + w)` and store `w`, plain RMSNorms store the scale itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import CacheError
from ..io_utils import atomic_output, atomic_write_json

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
              "norm.weight")
HEAD_CONFIG_KEY = "dflash_config"
# model_type prefixes whose RMSNorm scale is (1 + stored weight).
ZERO_CENTERED_NORM_TYPES = ("qwen3_5", "qwen3_next", "gemma")


class EmbeddingsAndHead(NamedTuple):
    embed_VH: torch.Tensor
    lm_head_VH: torch.Tensor           # the same tensor object as embed_VH when tied
    final_norm_scale_H: torch.Tensor | None


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _is_tied(config: dict) -> bool:
    text = _text_config(config)
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return bool(config.get("tie_word_embeddings", False))


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index if there is one, else from the file headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CacheError(f"{index}: unreadable shard index: {exc}", "re-download the checkpoint") from exc
        return {name: model_dir / fname for name, fname in weight_map.items()}
    from safetensors import safe_open

    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        raise CacheError(f"{model_dir}: no *.safetensors files",
                         "the target directory must hold safetensors weights (pickle checkpoints are refused)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def _read(locations: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    path = locations[name]
    if not path.is_file():
        raise CacheError(f"{path}: shard listed for tensor '{name}' is missing", "re-download the checkpoint")
    with safe_open(str(path), framework="pt") as sf:
        return sf.get_tensor(name)


def _first(locations: dict[str, Path], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in locations), None)


def _load_config_and_locations(path: Path) -> tuple[dict, dict[str, Path]]:
    if path.is_file():
        # A single head file written by save_embeddings_and_head: the config rides in its metadata.
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as sf:
                meta = sf.metadata() or {}
                names = list(sf.keys())
        except Exception as exc:
            raise CacheError(f"{path}: not a readable safetensors file: {exc}",
                             f"delete {path} and rerun `dflash-pipe extract` with the cache's settings: it "
                             "rewrites the head file and keeps the committed shards") from exc
        if HEAD_CONFIG_KEY not in meta:
            raise CacheError(f"{path}: no '{HEAD_CONFIG_KEY}' metadata; not a dflash-pipe target head file",
                             "pass the target's model directory or the cache's head file")
        return json.loads(meta[HEAD_CONFIG_KEY]), {n: path for n in names}
    cfg_path = path / "config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"{cfg_path}: cannot read the target config: {exc}",
                         "point at the target's model directory (with config.json)") from exc
    return config, _tensor_locations(path)


def read_embeddings_and_head(model_dir: str | Path) -> EmbeddingsAndHead:
    """Read only embed_tokens, lm_head (or the tied embedding) and the final norm.

    `model_dir` is a checkpoint directory (single-file or sharded) or a head file written by
    `save_embeddings_and_head`.
    """
    model_dir = Path(model_dir)
    config, locations = _load_config_and_locations(model_dir)
    embed_name = _first(locations, EMBED_NAMES)
    if embed_name is None:
        raise CacheError(f"{model_dir}: no token embedding tensor (looked for {', '.join(EMBED_NAMES)})",
                         "this checkpoint layout is not supported")
    embed = _read(locations, embed_name)
    head_name = _first(locations, HEAD_NAMES)
    if _is_tied(config) or head_name is None:
        if not _is_tied(config):
            raise CacheError(f"{model_dir}: config says tie_word_embeddings=false but there is no lm_head tensor",
                             "the checkpoint is incomplete")
        head = embed
    else:
        head = _read(locations, head_name)
    if head.shape != embed.shape:
        raise CacheError(f"{model_dir}: lm_head {tuple(head.shape)} and embed_tokens {tuple(embed.shape)} differ "
                         "in shape", "a head over a different vocabulary is not supported")
    norm_name = _first(locations, NORM_NAMES)
    norm = None
    if norm_name is not None:
        norm = _read(locations, norm_name)
        model_type = str(_text_config(config).get("model_type", config.get("model_type", "")))
        if model_type.startswith(ZERO_CENTERED_NORM_TYPES):
            norm = 1.0 + norm.float()
    return EmbeddingsAndHead(embed, head, norm)


def save_embeddings_and_head(bundle, out_path: str | Path) -> Path:
    """Write the bundle's embedding, head and final norm so `read_embeddings_and_head` can read them.

    `out_path` ending in `.safetensors`: one file, the small config (model_type,
    tie_word_embeddings, sizes, provenance) in its metadata. Otherwise: a minimal checkpoint
    directory (config.json + model.safetensors). Tensors keep the plain causal-LM names and the
    raw stored norm weight, so the reader treats it exactly like a real checkpoint. Writes are
    atomic (the directory form writes config.json last).
    """
    from safetensors.torch import save_file

    out_path = Path(out_path)
    model = bundle.model
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embed or head.data_ptr() == embed.data_ptr()
    tensors = {"model.embed_tokens.weight": embed.detach().cpu().contiguous()}
    if not tied:
        tensors["lm_head.weight"] = head.detach().cpu().contiguous()
    norm = getattr(model.base_model, "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        tensors["model.norm.weight"] = norm.weight.detach().cpu().contiguous()
    config = {
        "model_type": bundle.config.model_type,
        "architectures": [type(model).__name__],
        "tie_word_embeddings": bool(tied),
        "hidden_size": bundle.hidden_size,
        "vocab_size": bundle.vocab_size,
        "num_hidden_layers": bundle.num_layers,
        "dflash_source": bundle.identity.get("model"),
        "weights_fingerprint": bundle.identity.get("weights_fingerprint"),
    }
    if out_path.suffix == ".safetensors":
        with atomic_output(out_path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt", HEAD_CONFIG_KEY: json.dumps(config, sort_keys=True)})
        return out_path
    out_path.mkdir(parents=True, exist_ok=True)
    with atomic_output(out_path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_path / "config.json", config)
    return out_path
