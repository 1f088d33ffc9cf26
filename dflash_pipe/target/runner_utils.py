"""Small accessors into a causal LM and the chunked top-k of its next-token distribution."""

from __future__ import annotations

import torch

from ..errors import RuntimeFailure


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


def chunked_topk_logprobs(final_hidden_TH: torch.Tensor, lm_head: torch.nn.Module, k: int, chunk: int,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and log-probs (fp16) of log_softmax(lm_head(h)), `chunk` tokens at a time.

    Only one [chunk, V] block of logits exists at a time (V = 248,320 makes the whole-row
    fp32 logits of 8k tokens 8 GB). The logits come out of lm_head in the model dtype, exactly
    like the HF forward; the normaliser is a float32 logsumexp over them, and
    log p = logit - logsumexp is formed in float32 before the fp16 cast.
    """
    T = final_hidden_TH.shape[0]
    device = final_hidden_TH.device
    ids_out = torch.empty((T, k), dtype=torch.int32, device=device)
    lp_out = torch.empty((T, k), dtype=torch.float16, device=device)
    for s in range(0, T, chunk):
        logits = lm_head(final_hidden_TH[s:s + chunk])
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        vals, idx = torch.topk(logits, k, dim=-1)
        ids_out[s:s + chunk] = idx.to(torch.int32)
        lp_out[s:s + chunk] = (vals - lse).to(torch.float16)
        del logits, lse, vals, idx
    return ids_out, lp_out
