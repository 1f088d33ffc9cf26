"""The dflash-pipe DFlash drafter as a transformers model, for `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

`dflash-pipe export --with-modeling-code` copies this file into the export directory and adds
`auto_map` to its config.json. The file is self-contained on purpose: it imports only torch and
transformers, so it works in an environment without dflash-pipe. The serving engines (vLLM,
SGLang) do not use it; they implement DFlash in-tree and read config.json + model.safetensors.

The math is the project's drafter (dflash_pipe/drafter/model.py) for one block at a time, the
call z-lab's DFlashDraftModel uses:

    h = hidden_norm(fc(target_hidden))                     context features, shared by all layers
    per layer:  x_n = input_layernorm(x)
                q   = rope(q_norm(q_proj(x_n)))            block positions
                k   = [rope(k_norm(k_proj(h))) ; rope(k_norm(k_proj(x_n)))]
                v   = [v_proj(h) ; v_proj(x_n)]
                x   = x + o_proj(attention(q, k, v))       every block query sees the whole context
                x   = x + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(x)
    out = norm(x)                                          apply the target's frozen lm_head to it

Weights: fc.weight, hidden_norm.weight, layers.{i}.*, norm.weight (no embeddings, no lm_head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashPipeConfig(Qwen3Config):
    """Qwen3Config (model_type "qwen3") of a DFlash drafter; the DFlash keys live in `dflash_config`."""

    model_type = "qwen3"


def _dflash_value(config, name: str, default=None):
    """dflash_config[name], else the top-level key (the order z-lab and SGLang read them in)."""
    block = getattr(config, "dflash_config", None) or {}
    return block.get(name, getattr(config, name, default))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 1e6)))


class DFlashPipeRMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.to(torch.promote_types(in_dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)


def _rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [b, T, head_dim] of plain (rotate_half, full head_dim) RoPE, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                                / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, T, heads, D]; cos/sin [b, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class DFlashPipeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = DFlashPipeRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashPipeRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, h, rope_block, rope_ctx, attention_mask):
        b, q_len, _ = x.shape
        ctx_len, d = h.shape[1], self.head_dim
        q = _apply_rope(self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, d)), *rope_block)
        k_ctx = _apply_rope(self.k_norm(self.k_proj(h).view(b, ctx_len, self.num_kv_heads, d)), *rope_ctx)
        k_blk = _apply_rope(self.k_norm(self.k_proj(x).view(b, q_len, self.num_kv_heads, d)), *rope_block)
        k = torch.cat((k_ctx, k_blk), dim=1)
        v = torch.cat((self.v_proj(h), self.v_proj(x)), dim=1).view(b, ctx_len + q_len, self.num_kv_heads, d)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class DFlashPipeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashPipeLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DFlashPipeAttention(config)
        self.mlp = DFlashPipeMLP(config)
        self.input_layernorm = DFlashPipeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashPipeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, h, rope_block, rope_ctx, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), h, rope_block, rope_ctx, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashPipeDraftModel(PreTrainedModel):
    """fc + hidden_norm + draft layers + norm. `forward` drafts one block per batch row."""

    config_class = DFlashPipeConfig
    base_model_prefix = "dflash_drafter"
    _no_split_modules = ["DFlashPipeLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashPipeRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashPipeLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashPipeRMSNorm(hidden, config.rms_norm_eps)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashPipeRMSNorm):
            module.weight.fill_(1.0)

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Final-normed hidden states [b, Q, hidden] of the block tokens.

        target_hidden [b, S, len(target_layer_ids) * hidden]: the target's features at the chosen
        layers (layer outputs, HF hidden_states[id + 1], concatenated) for the S context tokens.
        noise_embedding [b, Q, hidden]: the target's embeddings of [anchor token, mask x (Q - 1)].
        position_ids [b, S + Q]: context positions, then the block's.
        attention_mask: optional bool [b, 1, Q, S + Q] (True = attend); by default every block
        query sees the whole context and the whole block.
        """
        want = len(self.target_layer_ids) * self.config.hidden_size
        if target_hidden.dim() != 3 or target_hidden.shape[-1] != want:
            raise ValueError(f"target_hidden has shape {tuple(target_hidden.shape)}, want [b, S, {want}]")
        ctx_len, q_len = target_hidden.shape[1], noise_embedding.shape[1]
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(f"position_ids has {position_ids.shape[-1]} positions, want S + Q = {ctx_len + q_len}")
        dtype = self.norm.weight.dtype
        position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        head_dim = self.layers[0].self_attn.head_dim if len(self.layers) else 0
        cos, sin = _rope(position_ids, head_dim, _rope_theta(self.config), dtype)
        rope_ctx, rope_block = (cos[:, :ctx_len], sin[:, :ctx_len]), (cos[:, ctx_len:], sin[:, ctx_len:])
        h = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        for layer in self.layers:
            x = layer(x, h, rope_block, rope_ctx, attention_mask)
        return self.norm(x)
