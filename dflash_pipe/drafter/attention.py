"""Attention of the draft layers: one function, two paths that compute the same thing.

* flex (CUDA training): a module-level `torch.compile(flex_attention, dynamic=False)` called from
  eager code with the row's BlockMask. That is what gives the fused block-sparse forward and
  backward (SPEC §6: 4 ms / 0.4 GiB versus 318 ms / 105 GiB for the eager dense fallback).
  autocast does not reach into flex, so q/k/v are cast to bf16 here. GQA via enable_gqa.
* sdpa (CPU, and a reference on CUDA): `F.scaled_dot_product_attention` with the dense [Q, KV]
  bool mask; KV heads are repeated to the query heads. flex has no CPU backward (torch 2.13),
  so CPU training uses this path; tests prove both equal.
* sdpa-grouped (eager, any device): the same SDPA, batched over groups of consecutive blocks, each
  group scoring only the context span its blocks can see and its own blocks (grouped.py). Same
  softmax as the dense mask, without its Q x (S + N*B) grid; no compile.

Recompiles: with fixed shapes the compiled flex function and the compiled BlockMask builder
compile once. A new shape would silently recompile, and after `recompile_limit` (8) dynamo
silently runs the function eagerly, i.e. the dense fallback that OOMs at the seed's size. The
trainer therefore calls `lock_compilation()` after its first full step (forward, backward and
BlockMask build, and once more per distinct grad mode, e.g. a no-grad eval step): from then on
any recompile raises `RuntimeFailure` instead. `torch.compiler.set_stance("fail_on_recompile")`
exists from torch 2.6 (so on the 2.11 GPU image and the 2.13 CPU venv).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from ..errors import RuntimeFailure, UsageError
from .grouped import GROUP_BLOCKS, grouped_attend
from .masks import AttentionMask

FLEX_ATTENTION = torch.compile(flex_attention, dynamic=False)
# Tile sizes (BlockMask Q/KV block and Triton kernel options). Set once, before the first step,
# with `set_flex_tuning`; bench/flex_kernel.py measures the choices.
_FLEX_TUNING: dict = {"block": (128, 128), "kernel_options": None}


def set_flex_tuning(q_block: int = 128, kv_block: int = 128, kernel_options: dict | None = None) -> None:
    """Choose flex tile sizes. Non-default tiles also set the matching Triton block options."""
    opts = dict(kernel_options or {})
    if (q_block, kv_block) != (128, 128) and not opts:
        opts = {"BLOCK_M": q_block, "BLOCK_N": kv_block, "BLOCK_M1": min(q_block, 64), "BLOCK_N1": kv_block,
                "BLOCK_M2": q_block, "BLOCK_N2": min(kv_block, 64)}
    _FLEX_TUNING["block"] = (q_block, kv_block)
    _FLEX_TUNING["kernel_options"] = opts or None


def flex_tuning() -> dict:
    return dict(_FLEX_TUNING)

_RECOMPILE_MARK = "fail_on_recompile"
_lock_state: dict[str, object] = {"locked": False, "limit_hit": None}


def lock_compilation() -> None:
    """Make every later torch.compile recompilation an error (call after the warm-up step)."""
    if not hasattr(torch.compiler, "set_stance"):
        raise RuntimeFailure(f"torch {torch.__version__} has no torch.compiler.set_stance; cannot lock compilation",
                             "use torch >= 2.6")
    torch.compiler.set_stance(_RECOMPILE_MARK)
    dyn_cfg = torch._dynamo.config
    if hasattr(dyn_cfg, "fail_on_recompile_limit_hit"):
        _lock_state["limit_hit"] = dyn_cfg.fail_on_recompile_limit_hit
        dyn_cfg.fail_on_recompile_limit_hit = True
    _lock_state["locked"] = True


def unlock_compilation() -> None:
    if not _lock_state["locked"]:
        return
    torch.compiler.set_stance("default")
    if _lock_state["limit_hit"] is not None:
        torch._dynamo.config.fail_on_recompile_limit_hit = _lock_state["limit_hit"]
    _lock_state["locked"] = False


def compilation_locked() -> bool:
    return bool(_lock_state["locked"])


@contextmanager
def compilation_unlocked() -> Iterator[None]:
    """Temporarily allow compiles (e.g. a first eval step with another grad mode or shape)."""
    was_locked = compilation_locked()
    unlock_compilation()
    try:
        yield
    finally:
        if was_locked:
            lock_compilation()


@contextmanager
def reraise_recompile(what: str) -> Iterator[None]:
    """Turn dynamo's fail_on_recompile RuntimeError into a RuntimeFailure that says what to do."""
    try:
        yield
    except RuntimeError as exc:
        if _RECOMPILE_MARK in str(exc) or "recompile_limit" in str(exc):
            raise RuntimeFailure(
                f"torch.compile wanted to recompile while {what} (shapes or grad mode changed after warm-up): {exc}",
                "keep context_tokens / num_anchors / block_size fixed for every step, or warm up each "
                "variant before lock_compilation()") from exc
        raise


def flex_attend(q_BHQD: torch.Tensor, k_BKVD: torch.Tensor, v_BKVD: torch.Tensor, mask: AttentionMask, *,
                compiled: bool = True, dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """flex_attention over the row's BlockMask. dtype=None keeps the input dtype (CPU tests)."""
    out_dtype = q_BHQD.dtype
    if dtype is not None:
        q_BHQD, k_BKVD, v_BKVD = (t.to(dtype) for t in (q_BHQD, k_BKVD, v_BKVD))
    scale = q_BHQD.shape[-1] ** -0.5
    block_mask = mask.block_mask(compiled=compiled, flex_block=_FLEX_TUNING["block"])
    enable_gqa = k_BKVD.shape[1] != q_BHQD.shape[1]
    if compiled:
        opts = _FLEX_TUNING["kernel_options"]
        kw = {"kernel_options": opts} if opts else {}
        with reraise_recompile("running the compiled flex_attention"):
            out = FLEX_ATTENTION(q_BHQD, k_BKVD, v_BKVD, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                 **kw)
    else:
        out = flex_attention(q_BHQD, k_BKVD, v_BKVD, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    return out.to(out_dtype)


def sdpa_attend(q_BHQD: torch.Tensor, k_BKVD: torch.Tensor, v_BKVD: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """SDPA with the dense bool mask; KV heads repeated to match the query heads."""
    groups = q_BHQD.shape[1] // k_BKVD.shape[1]
    if groups > 1:
        k_BKVD = k_BKVD.repeat_interleave(groups, dim=1)
        v_BKVD = v_BKVD.repeat_interleave(groups, dim=1)
    scale = q_BHQD.shape[-1] ** -0.5
    return F.scaled_dot_product_attention(q_BHQD, k_BKVD, v_BKVD, attn_mask=mask.dense_bool(), scale=scale)


def attend(q_BHQD: torch.Tensor, k_BKVD: torch.Tensor, v_BKVD: torch.Tensor, mask: AttentionMask, path: str, *,
           flex_compiled: bool = True, flex_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """Masked attention, q [1, Hq, Q, D], k/v [1, Hkv, S+Q, D] -> [1, Hq, Q, D]."""
    if q_BHQD.shape[1] % k_BKVD.shape[1]:
        raise UsageError(f"attention: {q_BHQD.shape[1]} query heads are not a multiple of {k_BKVD.shape[1]} KV heads")
    if q_BHQD.shape[2] != mask.q_len or k_BKVD.shape[2] != mask.kv_len:
        raise UsageError(f"attention: q/kv lengths {q_BHQD.shape[2]}/{k_BKVD.shape[2]} do not match the mask "
                         f"{mask.q_len}/{mask.kv_len}")
    if path == "flex":
        return flex_attend(q_BHQD, k_BKVD, v_BKVD, mask, compiled=flex_compiled, dtype=flex_dtype)
    if path == "sdpa":
        return sdpa_attend(q_BHQD, k_BKVD, v_BKVD, mask)
    if path == "sdpa-grouped":
        return grouped_attend(q_BHQD, k_BKVD, v_BKVD, mask.grouped(GROUP_BLOCKS["blocks"]), q_BHQD.shape[-1] ** -0.5)
    raise UsageError(f"attention path must be 'flex', 'sdpa' or 'sdpa-grouped', got {path!r}")
