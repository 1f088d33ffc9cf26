"""Export a trained drafter in the format vLLM / SGLang / z-lab load (SPEC §9).

`<out_dir>/config.json` + `<out_dir>/model.safetensors` (bf16). The config follows z-lab's
published drafts (e.g. z-lab/Qwen3-8B-DFlash-b16: `architectures: ["DFlashDraftModel"]`,
`model_type: "qwen3"`, `block_size` top-level, `dflash_config: {mask_token_id,
target_layer_ids}`, `num_target_layers` = the target's layer count, `layer_types`) and the
newer ones (e.g. z-lab/Qwen3.5-*-DFlash: `rope_parameters` and `block_size` also inside
dflash_config). Both `rope_theta` and `rope_parameters` are written so readers built on
transformers 4.x (top-level rope_theta) and 5.x (rope_parameters) find the same value.
No `auto_map`: the serving engines implement DFlash in-tree and no Python code is shipped.

The tensors are exactly the model's state_dict (names `layers.{i}.self_attn.q_proj.weight`, ...,
`fc.weight`, `hidden_norm.weight`, `norm.weight`); embed_tokens / lm_head stay with the target.
Both files are written atomically (temp + fsync + rename). Loading checks the names and shapes
strictly: a missing or extra tensor is a CacheError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CacheError, ValidationError
from ..io_utils import atomic_output, atomic_write_json
from .config import DrafterModelConfig
from .model import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EXPORT_DTYPE = torch.bfloat16


def export_config(cfg: DrafterModelConfig) -> dict[str, Any]:
    """The config.json dict for `cfg` (SPEC §9 keys plus the usual Qwen3 ones)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
        "num_target_layers": cfg.num_target_layers,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "initializer_range": cfg.initializer_range,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def config_from_export(d: dict[str, Any], where: str) -> DrafterModelConfig:
    """Inverse of `export_config` (also reads z-lab configs that lack our optional keys)."""
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        raise ValidationError(f"{where}: architectures {d.get('architectures')} is not ['DFlashDraftModel']",
                              "this is not a DFlash drafter export")
    dflash = d.get("dflash_config") or {}
    try:
        theta = d.get("rope_theta") or (d.get("rope_parameters") or {})["rope_theta"]
        block = dflash.get("block_size", d.get("block_size"))
        return DrafterModelConfig(
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d["head_dim"]),
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope_theta=float(theta),
            block_size=int(block),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            num_target_layers=int(d["num_target_layers"]),
            vocab_size=int(d["vocab_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValidationError(f"{where}: missing or malformed key {exc}",
                              "re-export the drafter with `dflash-pipe train` / export_drafter") from None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The DFlashDrafter inside DDP (`.module`) and/or torch.compile (`._orig_mod`) wrappers."""
    while not isinstance(model, DFlashDrafter):
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            raise ValidationError(f"export_drafter: expected a DFlashDrafter, got {type(model).__name__}")
        model = inner
    return model


def plain_name(name: str) -> str:
    """A parameter name without torch.compile's `_orig_mod.` components."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def export_drafter(model: DFlashDrafter, cfg: DrafterModelConfig, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (bf16) into out_dir, atomically. Returns out_dir."""
    out = Path(out_dir)  # created by atomic_output (an unwritable path is then exit 4 naming it)
    model = unwrap_model(model)
    # the trainer compiles each draft layer (`layers.i = torch.compile(layer)`), which puts the layer's
    # parameters under `layers.i._orig_mod.`: the exported names are the plain module's
    tensors = {plain_name(name): t.detach().to(device="cpu", dtype=EXPORT_DTYPE).contiguous()
               for name, t in model.state_dict().items()}
    with torch.device("meta"):
        expected = set(DFlashDrafter(cfg).state_dict())
    if set(tensors) != expected:
        raise ValidationError(f"export_drafter: the model's tensors do not match the config "
                              f"(missing: {sorted(expected - set(tensors))[:5]}, "
                              f"unexpected: {sorted(set(tensors) - expected)[:5]})")
    with atomic_output(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "dflash-pipe"})
    atomic_write_json(out / CONFIG_NAME, export_config(cfg))
    return out


def load_exported_drafter(export_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", attention: str | None = None):
    """Read an export back: (DFlashDrafter in `dtype` on `device`, DrafterModelConfig)."""
    d = Path(export_dir)
    cfg_path, weights_path = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not cfg_path.is_file() or not weights_path.is_file():
        raise CacheError(f"{d}: a drafter export needs {CONFIG_NAME} and {WEIGHTS_NAME}",
                         "point at the export directory written by `dflash-pipe train`")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheError(f"{cfg_path}: not valid JSON: {exc}") from None
    cfg = config_from_export(raw, str(cfg_path))
    if attention is not None:
        cfg.attention = attention
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = set(f.keys())
            missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
            if missing or extra:
                raise CacheError(f"{weights_path}: tensor names do not match the config "
                                 f"(missing: {missing[:5]}, unexpected: {extra[:5]})")
            for name in expected:
                t = f.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    raise CacheError(f"{weights_path}: tensor {name} has shape {tuple(t.shape)}, "
                                     f"config implies {expected[name]}")
                state[name] = t.to(device=device, dtype=dtype)
    except CacheError:
        raise
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise CacheError(f"{weights_path}: cannot read safetensors file: {exc}") from None
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(state, strict=True)
    return model, cfg
