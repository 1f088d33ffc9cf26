"""Small accessors into a causal LM (the chunked top-k of its next-token distribution lives in topk.py)."""

from __future__ import annotations

import inspect

import torch

from ..errors import RuntimeFailure
from .host_upload import upload as to_device  # noqa: F401  (the engine's and regenerate's import path)
from .topk import chunked_topk_logprobs  # noqa: F401  (re-exported: the runner's and the tests' import path)


def text_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (LlamaModel, Qwen3_5TextModel, ...) without the LM head."""
    base = getattr(model, "base_model", model)
    lm = getattr(base, "language_model", None)   # vision-language wrappers
    return lm if lm is not None and hasattr(lm, "layers") else base


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    backbone = text_backbone(model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise RuntimeFailure(f"{type(model).__name__}: cannot find the decoder layers (no .layers on the backbone)",
                             "this model architecture is not supported by the target runner")
    return layers


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(text_backbone(model), "norm", None)


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """'linear_attention' or 'full_attention' per decoder layer, read from the modules."""
    kinds = []
    for layer in decoder_layers(model):
        kinds.append("linear_attention" if getattr(layer, "linear_attn", None) is not None else "full_attention")
    return kinds


def accepts_mask_mapping(backbone: torch.nn.Module) -> bool:
    """Whether the backbone's forward takes a prebuilt {layer_type: mask} dict as `attention_mask`.

    transformers' hybrid models (Qwen3.5 in 5.17/5.24) skip their own mask construction when given
    one (`if not isinstance(causal_mask_mapping := attention_mask, dict)`). That construction calls
    `find_packed_sequence_indices(position_ids)`, whose Python `if (...).all()` is a host sync on
    every forward without a tensor mask. Read from the forward's source: False when unsure.
    """
    layer_types = getattr(getattr(backbone, "config", None), "layer_types", None)
    if not layer_types:
        return False
    try:
        src = inspect.getsource(type(backbone).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in src
