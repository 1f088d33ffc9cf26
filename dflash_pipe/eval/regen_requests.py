"""What regenerate's backends take and give back (regen_backends, regen_hf), and the engine's default batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TurnRequest:
    state: object          # the conversation (regenerate._ConvState)
    prompt: list[int]
    key: int               # sampling key (regen_sampling.answer_key)
    order: int             # the conversation's input position: the ready list's sort key


@dataclass
class Held:
    """A finished row kept for its conversation's next turn (history reuse)."""
    state: object          # the conversation (regenerate._ConvState)
    fed: list[int]         # the tokens whose K/V the row holds: the prompt and the answer but its last token
    launches: int = 0      # launches since the answer finished


@dataclass
class Completion:
    request: TurnRequest
    tokens: list[int]      # the answer without its end-of-turn token
    ended: bool            # True when an EOS token ended it, False when it hit max_new_tokens
    end_token: int | None = None   # the EOS token that ended it (engine backend; the eval keeps it in its output)


def auto_batch_size(model: torch.nn.Module, max_len: int, cap: int = 1024) -> int:
    """CPU: 16. CUDA: as many rows as fit in half the free memory with K/V for max_len tokens each."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return 16
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (max_len + 1) * head_dim * p.element_size()
    free, _ = torch.cuda.mem_get_info(p.device)
    return max(1, min(cap, int(0.5 * free) // per_row))
