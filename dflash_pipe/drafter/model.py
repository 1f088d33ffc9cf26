"""The DFlash drafter (SPEC §4), with z-lab compatible parameter names (SPEC §9).

Math, checked against z-lab/dflash `dflash/model.py` (Qwen3DFlashAttention / DFlashDraftModel)
and vLLM's `qwen3_dflash.py` (`precompute_and_store_context_kv`), which serve these weights:

    h      = hidden_norm(fc(concat(target layers)))             once, shared by all layers
    layer: x_n    = input_layernorm(x)                          block tokens only
           q      = rope(q_norm(q_proj(x_n)), block positions)
           k      = [rope(k_norm(k_proj(h)), ctx positions) ; rope(k_norm(k_proj(x_n)), block positions)]
           v      = [v_proj(h) ; v_proj(x_n)]                   (no norm on v)
           x      = x + o_proj(attention(q, k, v, mask))
           x      = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    out    = norm(x)                                            the caller applies the frozen lm_head

In particular the context features h enter k_proj/v_proj of every layer *without*
input_layernorm (z-lab passes `target_hidden` straight to `self.k_proj`; vLLM applies only
hidden_norm before its fused context-KV GEMM), and the block tokens' keys/values come from the
*normed* block hidden states, the same tensor that produces q. RoPE is the plain Qwen3/Llama
"rotate_half" form over the full head_dim; RMSNorm computes in fp32 and casts back (Qwen3RMSNorm).

The public API is unbatched: one packed row per rank. Internally attention runs with batch 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError, ValidationError
from .attention import attend
from .config import ATTENTION_PATHS, DrafterModelConfig
from .masks import AttentionMask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.to(torch.promote_types(in_dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, head_dim] for integer positions, computed in fp32 (fp64 if asked) then cast."""
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=calc) / head_dim))
    freqs = positions.to(calc)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_THD.shape[-1] // 2
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + rotated * sin_TD[:, None, :]


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def context_kv(self, h_SH, rope_ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [S, kv_heads, D] of context rows. They do not depend on the block, so inference computes
        them once per committed token (`DFlashDrafter.context_kv`) instead of once per step."""
        ctx_len, d = h_SH.shape[0], self.head_dim
        k_ctx = apply_rope(self.k_norm(self.k_proj(h_SH).view(ctx_len, self.num_kv_heads, d)), *rope_ctx)
        return k_ctx, self.v_proj(h_SH).view(ctx_len, self.num_kv_heads, d)

    def forward(self, x_QH, h_SH, rope_block, rope_ctx, mask: AttentionMask, path: str, flex_opts: dict,
                kv_ctx: tuple[torch.Tensor, torch.Tensor] | None = None):
        q_len, d = x_QH.shape[0], self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x_QH).view(q_len, self.num_heads, d)), *rope_block)
        k_ctx, v_ctx = self.context_kv(h_SH, rope_ctx) if kv_ctx is None else kv_ctx
        k_blk = apply_rope(self.k_norm(self.k_proj(x_QH).view(q_len, self.num_kv_heads, d)), *rope_block)
        v_blk = self.v_proj(x_QH).view(q_len, self.num_kv_heads, d)
        k = torch.cat((k_ctx, k_blk.to(k_ctx.dtype)), dim=0)
        v = torch.cat((v_ctx, v_blk.to(v_ctx.dtype)), dim=0)
        # [T, heads, D] -> [1, heads, T, D]
        out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, path,
                     **flex_opts)
        return self.o_proj(out[0].transpose(0, 1).reshape(q_len, self.num_heads * d))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Recompute norm + MLP in backward: keeps only the MLP input instead of its three
        # [Q, intermediate] activations (the largest ones); costs the gate/up GEMMs once more.
        self.checkpoint_mlp = False

    def _mlp_block(self, x_QH):
        return self.mlp(self.post_attention_layernorm(x_QH))

    def forward(self, x_QH, h_SH, rope_block, rope_ctx, mask, path, flex_opts, kv_ctx=None):
        x_QH = x_QH + self.self_attn(self.input_layernorm(x_QH), h_SH, rope_block, rope_ctx, mask, path, flex_opts,
                                     kv_ctx)
        if self.checkpoint_mlp and torch.is_grad_enabled():
            return x_QH + checkpoint(self._mlp_block, x_QH, use_reentrant=False)
        return x_QH + self._mlp_block(x_QH)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm + `num_layers` draft layers + final norm. No embeddings, no lm_head.

    attention: 'flex' | 'sdpa' | 'sdpa-grouped' (default cfg.attention). flex_compiled=False runs the uncompiled
    flex function (CPU tests only); flex_dtype=None keeps q/k/v in their dtype instead of bf16.
    gradient_checkpointing: recompute each layer in backward (saves activation memory).
    """

    def __init__(self, cfg: DrafterModelConfig, attention: str | None = None, *, flex_compiled: bool = True,
                 flex_dtype: torch.dtype | None = torch.bfloat16, gradient_checkpointing: bool = False):
        super().__init__()
        self.cfg = cfg
        self.attention = attention or cfg.attention
        if self.attention not in ATTENTION_PATHS:
            raise UsageError(f"drafter attention must be one of {', '.join(ATTENTION_PATHS)}, got {self.attention!r}")
        self.flex_opts = {"flex_compiled": flex_compiled, "flex_dtype": flex_dtype}
        self.gradient_checkpointing = gradient_checkpointing
        self.fc = nn.Linear(cfg.num_target_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Qwen3-style init: linear weights N(0, initializer_range), norm weights 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.cfg.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def _check_inputs(self, target_hidden_SF, block_embeds_QH, ctx_positions_S, block_positions_Q, mask):
        cfg = self.cfg
        s, q = target_hidden_SF.shape[0], block_embeds_QH.shape[0]
        problems = []
        if target_hidden_SF.dim() != 2 or target_hidden_SF.shape[1] != cfg.num_target_features * cfg.hidden_size:
            problems.append(f"target_hidden_SF {tuple(target_hidden_SF.shape)} != [S, {cfg.num_target_features}*"
                            f"{cfg.hidden_size}]")
        if block_embeds_QH.dim() != 2 or block_embeds_QH.shape[1] != cfg.hidden_size:
            problems.append(f"block_embeds_QH {tuple(block_embeds_QH.shape)} != [N*B, {cfg.hidden_size}]")
        if ctx_positions_S.shape != (s,) or block_positions_Q.shape != (q,):
            problems.append(f"positions {tuple(ctx_positions_S.shape)}/{tuple(block_positions_Q.shape)} != [{s}]/[{q}]")
        if mask.ctx_len != s or mask.q_len != q or mask.block_size != cfg.block_size:
            problems.append(f"mask (S={mask.ctx_len}, Q={mask.q_len}, B={mask.block_size}) does not match inputs "
                            f"(S={s}, Q={q}, B={cfg.block_size})")
        if problems:
            raise ValidationError("DFlashDrafter.forward: " + "; ".join(problems))

    def forward(self, target_hidden_SF: torch.Tensor, block_embeds_QH: torch.Tensor, ctx_positions_S: torch.Tensor,
                block_positions_Q: torch.Tensor, attn: AttentionMask) -> torch.Tensor:
        """Final-normed hidden states [N*B, H] of the block tokens (see the module docstring)."""
        self._check_inputs(target_hidden_SF, block_embeds_QH, ctx_positions_S, block_positions_Q, attn)
        param_dtype = self.norm.weight.dtype
        h_SH = self._context_hidden(target_hidden_SF)
        x_QH = block_embeds_QH.to(param_dtype)  # residual stream in the master-weight dtype
        # q/k leave q_norm/k_norm in the norm weights' dtype (fp32 master weights under autocast),
        # so RoPE is applied in that dtype too.
        rope_block = rope_cos_sin(block_positions_Q, self.cfg.head_dim, self.cfg.rope_theta, param_dtype)
        rope_ctx = rope_cos_sin(ctx_positions_S, self.cfg.head_dim, self.cfg.rope_theta, param_dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x_QH = checkpoint(layer, x_QH, h_SH, rope_block, rope_ctx, attn, self.attention, self.flex_opts,
                                  use_reentrant=False)
            else:
                x_QH = layer(x_QH, h_SH, rope_block, rope_ctx, attn, self.attention, self.flex_opts)
        return self.norm(x_QH)

    def _context_hidden(self, target_hidden_SF: torch.Tensor) -> torch.Tensor:
        """h = hidden_norm(fc(features)), shared by every layer's context keys and values."""
        # The master-weight dtype: norm weights stay fp32 when the Linear weights are bf16 compute
        # copies (train/master_weights.py); for an all-fp32 or all-bf16 drafter it is the weight dtype.
        # Under autocast the linears cast their inputs themselves; a bf16 feature matrix is not
        # copied to fp32 (at the seed's size that copy alone is 0.8 GB). Without autocast the
        # features must match the weights.
        autocast_on = torch.is_autocast_enabled(target_hidden_SF.device.type)
        feats = target_hidden_SF if autocast_on else target_hidden_SF.to(self.norm.weight.dtype)
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, target_hidden_SF: torch.Tensor, ctx_positions_S: torch.Tensor) -> list[tuple]:
        """Per layer, (k, v) [S, kv_heads, D] of these context rows (inference cache; see forward_cached)."""
        h_SH = self._context_hidden(target_hidden_SF)
        rope_ctx = rope_cos_sin(ctx_positions_S, self.cfg.head_dim, self.cfg.rope_theta, self.norm.weight.dtype)
        return [layer.self_attn.context_kv(h_SH, rope_ctx) for layer in self.layers]

    def forward_cached(self, kv_ctx: list[tuple], block_embeds_QH: torch.Tensor, block_positions_Q: torch.Tensor,
                       attn: AttentionMask) -> torch.Tensor:
        """forward() for inference with the context's per-layer (k, v) from context_kv (attn.ctx_len rows):
        the same math (vLLM's precomputed context KV), without recomputing fc and k/v over the context."""
        if len(kv_ctx) != len(self.layers) or any(k.shape[0] != attn.ctx_len for k, _ in kv_ctx):
            raise ValidationError(f"DFlashDrafter.forward_cached: want {len(self.layers)} (k, v) pairs of "
                                  f"{attn.ctx_len} context rows")
        param_dtype = self.norm.weight.dtype
        x_QH = block_embeds_QH.to(param_dtype)
        rope_block = rope_cos_sin(block_positions_Q, self.cfg.head_dim, self.cfg.rope_theta, param_dtype)
        for layer, kv in zip(self.layers, kv_ctx):
            x_QH = layer(x_QH, None, rope_block, None, attn, self.attention, self.flex_opts, kv)
        return self.norm(x_QH)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
