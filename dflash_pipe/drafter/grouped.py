"""Grouped SDPA: the training mask's attention without the dense [Q, S + N*B] grid (drafter attention 'sdpa-grouped').

The dense SDPA path (attention.sdpa_attend) scores each of the N*B queries against all S + N*B keys, although a
query sees at most its document's entries before its anchor and the B entries of its own block: at the quality
runs' shape (S 8192, 512 blocks of 16) that is 16,384 keys scored for a few hundred seen. The work grows with
N * (S + N*B), so twice the anchors cost about three times the attention.

Here the blocks go in groups of g consecutive blocks. Anchors are in context order (the loader keeps them so), so
a group's blocks see only a short stretch of the packed context: the union of their intervals [lo, hi)
(masks.context_ranges). Each group's keys are gathered into one row,

    [ context lo_g .. hi_g - 1, padded to the step's longest span W_c | the group's own g*B block entries ]

and one batched SDPA runs over [G groups, heads, g*B queries, W_c + g*B keys] with the mask restricted to those
columns. The keys left out are exactly keys the dense mask hides, so the softmax is the same (the tests compare it
with the dense path in float64, forward and backward). Cost: Q x (W_c + g*B) instead of Q x (S + N*B); at the
quality runs' shape with g = 32, W_c is about a thousand entries (32 anchors spread over ~512 packed tokens plus the
first anchor's document prefix).

The spans are the step's shapes, so they are host integers. They come from the batch's host tensors (the loader
builds every batch on the host), so building the layout never waits for the device; a mask built from device
tensors alone falls back to copying them to the host (one sync per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_BLOCKS = {"blocks": 32}   # blocks per group (set_group_blocks); the largest divisor of N at or below it is used
# The gathered row's width (context span + own blocks) is rounded up to a multiple of this many keys. cuDNN's SDPA
# (PyTorch's default backend on H100/H200) builds an execution plan for every new shape, ~140-160 ms each
# (bench/grouped_profile.py on the H100, session 24: 2.7 ms a call once the plan exists). Unrounded, the width is
# the step's longest span and changes nearly every step, so every step paid that build; rounded, a run sees a few
# dozen widths. The padding columns are masked out, so the result is unchanged; they add <= 127 keys to ~1-3 k.
WIDTH_QUANTUM = 128


def set_group_blocks(blocks: int) -> None:
    """Blocks per group of the grouped path (bench/train_step.py sweeps it). Fewer: narrower spans, more padding of
    the span to the step's longest; more: fewer, wider groups."""
    if blocks < 1:
        raise ValueError(f"set_group_blocks: {blocks} blocks per group; at least 1")
    GROUP_BLOCKS["blocks"] = int(blocks)


def group_size(num_blocks: int, target: int) -> int:
    """The largest divisor of num_blocks at or below target: every group then holds the same number of blocks."""
    for g in range(max(1, min(target, num_blocks)), 0, -1):
        if num_blocks % g == 0:
            return g
    return 1


def group_spans(ctx_lo_N: np.ndarray, ctx_hi_N: np.ndarray, valid_N: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group of g consecutive blocks, the context interval [lo, hi) covering its valid blocks' intervals
    ([0, 0) when no valid block of the group sees any context)."""
    lo = np.asarray(ctx_lo_N, dtype=np.int64).reshape(-1, g)
    hi = np.asarray(ctx_hi_N, dtype=np.int64).reshape(-1, g)
    sees = np.asarray(valid_N, dtype=bool).reshape(-1, g) & (hi > lo)
    big = np.iinfo(np.int64).max
    g_lo = np.where(sees, lo, big).min(axis=1)
    g_hi = np.where(sees, hi, 0).max(axis=1)
    none = ~sees.any(axis=1)
    return np.where(none, 0, g_lo), np.where(none, 0, g_hi)


@dataclass
class GroupedLayout:
    """The gathered key layout of one packed row: key_index[g, w] is the KV entry at column w of group g;
    mask[g, q, w] is True where query q of the group may attend to that column."""
    groups: int
    blocks_per_group: int
    key_index_GW: torch.Tensor   # int64 [G, W]
    mask_GQW: torch.Tensor       # bool [G, g*B, W]

    @property
    def width(self) -> int:
        return self.key_index_GW.shape[1]


def _repeat_each(x: torch.Tensor, r: int, dim: int) -> torch.Tensor:
    """repeat_interleave(x, r, dim) as expand + reshape: the same tensor, certainly without a host sync."""
    shape = list(x.shape)
    out = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], r, *shape[dim + 1:])
    return out.reshape(*shape[:dim], shape[dim] * r, *shape[dim + 1:])


def build_layout(ctx_lo_N: torch.Tensor, ctx_hi_N: torch.Tensor, span_lo_G: np.ndarray, span_hi_G: np.ndarray,
                 ctx_len: int, block_size: int, g: int) -> GroupedLayout:
    """The layout from the per-block intervals (device tensors) and the per-group spans (host arrays).
    The context part's width is the longest span, rounded up so that the whole row is a multiple of WIDTH_QUANTUM
    keys (one SDPA shape for many steps)."""
    device = ctx_lo_N.device
    G, B = len(span_lo_G), block_size
    width_ctx = int(np.max(span_hi_G - span_lo_G)) if G else 0
    width_ctx += -(width_ctx + g * B) % WIDTH_QUANTUM
    start = torch.as_tensor(np.ascontiguousarray(span_lo_G), dtype=torch.int64).to(device, non_blocking=True)
    cols = start[:, None] + torch.arange(width_ctx, device=device)[None, :]                     # [G, Wc]
    blo, bhi = ctx_lo_N.view(G, g, 1), ctx_hi_N.view(G, g, 1)
    sees_ctx = (cols[:, None, :] >= blo) & (cols[:, None, :] < bhi)                              # [G, g, Wc]
    own = _repeat_each(torch.eye(g, dtype=torch.bool, device=device), B, 1)                      # [g, g*B]
    per_block = torch.cat((sees_ctx, own.expand(G, g, g * B)), dim=2)                            # [G, g, W]
    blocks = ctx_len + torch.arange(G * g * B, device=device).view(G, g * B)
    index = torch.cat((cols.clamp(max=ctx_len - 1), blocks), dim=1)                              # [G, W]
    return GroupedLayout(G, g, index, _repeat_each(per_block, B, 1))


def layout_for(mask, target_blocks: int) -> GroupedLayout:
    """The grouped layout of an AttentionMask (masks.py), its spans from the mask's host tensors."""
    g = group_size(mask.num_blocks, target_blocks)
    lo, hi, valid = mask.host_ranges()
    s_lo, s_hi = group_spans(lo, hi, valid, g)
    return build_layout(mask.ctx_lo, mask.ctx_hi, s_lo, s_hi, mask.ctx_len, mask.block_size, g)


def grouped_attend(q_BHQD: torch.Tensor, k_BKVD: torch.Tensor, v_BKVD: torch.Tensor, layout: GroupedLayout,
                   scale: float) -> torch.Tensor:
    """q [1, Hq, Q, D], k/v [1, Hkv, S+Q, D] -> [1, Hq, Q, D], the same as SDPA under the dense mask."""
    _, H, Q, D = q_BHQD.shape
    G = layout.groups
    q = q_BHQD[0].reshape(H, G, Q // G, D).transpose(0, 1)                   # [G, Hq, g*B, D]
    flat = layout.key_index_GW.reshape(-1)      # index_select: its backward is an index_add (no host sync)
    k = k_BKVD[0].index_select(1, flat).view(-1, G, layout.width, D).transpose(0, 1)   # [G, Hkv, W, D]
    v = v_BKVD[0].index_select(1, flat).view(-1, G, layout.width, D).transpose(0, 1)
    groups = H // k.shape[1]
    if groups > 1:
        k, v = _repeat_each(k, groups, 1), _repeat_each(v, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask_GQW[:, None], scale=scale)
    return out.transpose(0, 1).reshape(1, H, Q, D)
