"""Static-KV decode engine for attention-only targets (Llama / SmolLM2, Qwen2, Qwen3).

`StaticKVEngine(model, max_batch, max_len)` preallocates K/V buffers
``[layers, max_batch, kv_heads, max_len + 1, head_dim]`` in the model dtype and one length per
row (on the device). ``forward(input_ids [B, T], num_new=None, rows=None)`` appends the T tokens
of every row at that row's length: RoPE at positions ``length .. length + T - 1``, causal within
the new tokens, keys at or beyond a row's length masked. ``num_new[b]`` (default T) is how many of
row b's T tokens are real: its length grows by that much and the others are right padding (their
outputs are garbage, their K/V land in the unused area). It returns the logits (all T positions,
or with ``last_only`` the last real one of each row) and, if `capture_layer_ids` was given, the
outputs of those decoder layers (the cache convention: HF ``hidden_states[id + 1]``; the last
layer after the final norm, like `dflash_pipe.target.runner`), concatenated in id order.
``truncate(row, n)`` rolls a row back to its first n tokens (only the length moves); ``reset``
empties rows (kv_rows.py: the buffers and the row operations).

The weights are the HF module's own (its projections, norms, MLPs, rotary embedding and head are
called as they are; nothing is copied); only the attention and the cache are ours. On CUDA a call
with ``rows=None`` (rows 0..B-1) and T <= 16 (decode / verify shapes; `forward` prefills run eagerly,
`prefill` below is bucketed and graphed) runs as
a CUDA graph captured once per (B, T, attended length, last_only): a whole step is one launch.
The attended length is the rows' largest possible length rounded up to `kv_bucket` (the host
tracks an upper bound per row, so choosing it never syncs), so SDPA does not read the whole
padded buffer; at large batch in bf16 / fp16 on CUDA (``attention`` auto or "rows") each row reads
only its own keys instead (decode_attention.py, a Triton kernel), which under continuous batching,
where some row is always near max_len, is most of the step's memory traffic. Outputs of a graphed call are static
buffers, overwritten by the next call: copy what you keep. On the CPU everything runs eagerly.

Bucketed prefill (``bucketed_prefill=True``, regenerate's continuous batching): ``prefill(prompts, rows)``
appends R prompts to R rows as one call padded to `prefill_shape(R, longest)` (prefill_shapes.py: rows up
to a power of two, tokens up to two buckets per octave, or a larger shape already in use that pads at most
2x: `prefill_reuse_ratio`). Padding rows
point at one scratch row beyond `max_batch` (allocated only in this mode), so they never touch a live row.
When every row of the call is empty (regenerate resets a row before refilling it) token t attends to the
new tokens 0..t alone: causal SDPA over the call's own keys, no read of the cache and no mask (stale keys of
a row's previous occupant are never looked at); otherwise the call appends like `forward`.
On CUDA a shape's first call runs eagerly (its warm-up) and its second one captures a CUDA graph (row indices, ids and lengths in static
inputs), replayed from then on; at most `max_prefill_graphs` prefill graphs (then eager), all in the one memory
pool of the decode graphs (graphs are replayed one after another, never concurrently). On the CPU the
same padded call runs eagerly (and no shape is reused: there is no graph to save).

Usage limits: a row's length + its real new tokens must stay <= max_len (writes beyond go to a
single spare slot and are lost); ``truncate`` only shrinks.

Small-batch ops (small_batch_ops.py, `LayerOps`; ``attention``, ``linear``, ``fused``, ``tune_rows``, ``norm`` pick
its modes): q|k|v and gate|up are fused once into one weight each, of which the HF parameters become
views (no copy; the HF model still works); the projections, the head, few-query attention (explicit
math below the SM count, else SDPA), RMSNorm and RoPE run through it rather than the HF modules. On CUDA in bf16 /
fp16 the rotation of q|k (with the K/V cache writes where the per-row kernel attends) and the MLP's SiLU(gate) * up
are one Triton kernel each (fused_elementwise.py).

Speculative verification at batch 1 (the eval's use)::

    eng = StaticKVEngine(model, max_batch=1, max_len=4096, capture_layer_ids=drafter_layer_ids)
    out = eng.forward(prompt_ids[None], last_only=True)     # logits [1, V]; hidden [1, P, n*H]
    ...
    out = eng.forward(block[None])                          # block = [last token, d_1..d_k]: logits [1, k+1, V]
    eng.truncate(0, p + 1 + accepted)                       # keep the accepted prefix, drop the rest
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UsageError
from .chunked_prefill import UploadedPrompts, chunked_prefill
from .decode_attention import row_attention as row_length_attention
from .decode_attention import supported as row_kernel_supported
from .fused_elementwise import rope_into_cache, rope_tokens
from .fused_elementwise import supported as fused_ok
from .kv_rows import KVRows
from .prefill_shapes import PrefillShapes, next_pow2
from .runner_utils import decoder_layers, final_norm, text_backbone, to_device
from .small_batch_ops import LayerOps, few_query_attention, few_query_bias, rope, signed_sin

log = logging.getLogger("dflash_pipe.target")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
GROUPED_QUERY_MAX_T = 16        # up to this many new tokens, query heads are folded onto their KV head
PREFILL_LAYOUTS = ("auto", "chunks", "padded")


def engine_support(model: torch.nn.Module) -> str | None:
    """None when the engine can run `model`; otherwise the reason it cannot (for the log)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model type '{mt}' is not one of {', '.join(SUPPORTED_MODEL_TYPES)} (attention-only families)"
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)} (only full attention is supported)"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(cfg, "final_logit_softcapping", None):
        return "logit soft-capping"
    try:
        layers = decoder_layers(model)
    except Exception as exc:  # noqa: BLE001 - any structural surprise means "not supported"
        return str(exc)
    need = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    if not all(hasattr(layers[0], n) for n in need) or getattr(text_backbone(model), "rotary_emb", None) is None:
        return f"{type(layers[0]).__name__} does not have the Llama layer structure"
    return None


@dataclass
class EngineOutput:
    logits: torch.Tensor | None        # [B, T, V], or [B, V] with last_only; None when the head was not applied
    hidden: torch.Tensor | None        # [B, T, n_layers * H] in capture_layer_ids order (all T, also with
                                       # last_only), or None
    last_hidden: torch.Tensor | None = None   # [B, H] before the head (a call with head=False and last_only)


class StaticKVEngine(KVRows):
    """Preallocated KV cache + own forward over the HF weights (module docstring)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_len: int, capture_layer_ids: Sequence[int] = (),
                 use_graphs: str = "auto", kv_bucket: int = 128, bucketed_prefill: bool = False,
                 prefill_min_rows: int = 8, max_prefill_graphs: int = 64, prefill_reuse_ratio: float = 2.0,
                 attention: str = "auto", linear: str = "auto", fused: bool = True,
                 tune_rows: Sequence[int] | None = None, norm: str = "auto", prefill_layout: str = "auto"):
        why = engine_support(model)
        if why is not None:
            raise UsageError(f"the static-KV engine cannot run this target: {why}")
        if max_batch < 1 or max_len < 1 or kv_bucket < 1:
            raise UsageError(f"max_batch ({max_batch}), max_len ({max_len}) and kv_bucket ({kv_bucket}) must be >= 1")
        self.model = model
        backbone = text_backbone(model)
        self.layers = list(decoder_layers(model))
        self.embed = backbone.embed_tokens
        self.norm = final_norm(model)
        self.rotary = backbone.rotary_emb
        self.lm_head = model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        attn = self.layers[0].self_attn
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.hidden_size = int(cfg.hidden_size)
        L = len(self.layers)
        self.capture_layer_ids = sorted(set(int(i) for i in capture_layer_ids))
        if any(not 0 <= i < L for i in self.capture_layer_ids):
            raise UsageError(f"capture layer ids {self.capture_layer_ids} outside the target's layers 0..{L - 1}")
        p = next(model.parameters())
        self.bucketed_prefill = bool(bucketed_prefill)
        # the K/V rows (+ a scratch row that padding rows of a prefill write to) and their lengths: kv_rows.py
        super().__init__(L, max_batch, max_len, self.kv_heads, self.head_dim, p.dtype, p.device, kv_bucket,
                         scratch_row=self.bucketed_prefill)
        self.prefill_min_rows, self.max_prefill_graphs = max(1, prefill_min_rows), max_prefill_graphs
        self._append_warm: set = set()       # graph keys of appending prefills that ran eagerly once
        self.prefill_graph_count = 0
        if use_graphs not in ("auto", "on", "off"):
            raise UsageError(f"use_graphs must be auto, on or off, got {use_graphs!r}")
        if use_graphs == "on" and self.device.type != "cuda":
            raise UsageError("CUDA graphs need a CUDA device")
        self.use_graphs = self.device.type == "cuda" and use_graphs != "off"
        self.ops = LayerOps(self.layers, self.lm_head, self.device, self.dtype, attention=attention, linear=linear,
                            fused=fused, tune_rows=(1, GROUPED_QUERY_MAX_T) if tune_rows is None and max_batch == 1
                            else tune_rows or (), norm=norm)   # small_batch_ops.py; linears timed for batch 1
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None
        # calls per padded prefill shape; a larger used shape is reused only where it saves a graph
        self.prefill_shapes = PrefillShapes(self.prefill_min_rows, max_len,
                                            prefill_reuse_ratio if self.use_graphs else 1.0)
        if prefill_layout not in PREFILL_LAYOUTS:
            raise UsageError(f"prefill_layout must be one of {', '.join(PREFILL_LAYOUTS)}, got {prefill_layout!r}")
        # fresh prompts as 16-token chunks (chunked_prefill.py) where the per-row attention kernel runs, else padded
        self.prefill_layout = ("chunks" if prefill_layout == "chunks" or (prefill_layout == "auto"
                                                                          and self._chunk_kernel()) else "padded")

    def row_attention(self, batch: int, T: int = 1) -> bool:
        """Whether a call of `batch` rows x T <= 16 new tokens attends each row over its own keys only
        (decode_attention.py) rather than over the padded `kv_len`."""
        G = self.heads // self.kv_heads
        return T <= GROUPED_QUERY_MAX_T and self.ops.row_attention(batch, self.kv_heads, G * T, self.head_dim)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_new: torch.Tensor | None = None,
                rows: Sequence[int] | None = None, last_only: bool = False) -> EngineOutput:
        """Append `input_ids` [B, T] to rows `rows` (default 0..B-1); see the module docstring."""
        if input_ids.ndim != 2:
            raise UsageError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        host_rows = list(range(B)) if rows is None else [int(r) for r in rows]
        if len(host_rows) != B or B > self.max_batch or any(not 0 <= r < self.max_batch for r in host_rows):
            raise UsageError(f"forward: {B} input rows for rows {host_rows[:8]}... of a {self.max_batch}-row cache")
        ids = to_device(input_ids.long(), self.device)
        nn_ = (torch.full((B,), T, dtype=torch.long, device=self.device) if num_new is None
               else to_device(num_new.long(), self.device))
        kv_len = self.attended_length(host_rows, T)
        for r in host_rows:
            self._bound[r] = min(self._bound[r] + T, self.max_len)
        if rows is None and self.use_graphs and T <= GROUPED_QUERY_MAX_T:
            return self._replay(ids, nn_, kv_len, last_only)
        row_t = None if rows is None else to_device(host_rows, self.device)
        return self._compute(ids, nn_, row_t, kv_len, last_only)

    @torch.inference_mode()
    def capturable_forward(self, input_ids: torch.Tensor, num_new: torch.Tensor) -> EngineOutput:
        """`forward` of rows 0..B-1 (device tensors) as kernels alone, for a caller to capture in its own CUDA graph
        (regenerate's lookup step): no graph of its own, no host bookkeeping, attending over the whole cache width
        (the host bounds cannot follow the rows: see `widen_bounds`). Graph it in `graph_pool`."""
        return self._compute(input_ids, num_new, None, self.size, False)

    @property
    def graph_pool(self):
        """The memory pool of this engine's CUDA graphs (graphs in it must never run concurrently)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(rows, tokens) a prefill of `rows` prompts, the longest `longest` tokens, would be padded to now."""
        return self.prefill_shapes.choose(rows, longest)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
        """Append prompt i to row rows[i] in one padded call (module docstring, bucketed prefill); the logits at
        each prompt's last token, [R, V]. With CUDA graphs this is a static buffer: use it before the next call."""
        if not self.bucketed_prefill:
            raise UsageError("prefill() needs an engine made with bucketed_prefill=True (it pads into a scratch row)")
        host_rows = [int(r) for r in rows]
        R, lens = len(prompts), [len(p) for p in prompts]
        if (R < 1 or len(host_rows) != R or len(set(host_rows)) != R
                or any(not 0 <= r < self.max_batch for r in host_rows)):
            raise UsageError(f"prefill: {R} prompts for rows {host_rows[:8]}... of a {self.max_batch}-row cache "
                             f"(one distinct row each)")
        if min(lens) < 1:
            raise UsageError(f"prefill: prompt {lens.index(0)} is empty")
        fresh = all(self._bound[r] == 0 for r in host_rows)     # empty rows: the prompts attend only to themselves
        self.last_uploaded = None                    # set by a fresh prefill: its prompt tokens on the device
        if fresh and self.prefill_layout == "chunks":
            return chunked_prefill(self, prompts, host_rows)
        Rb, Tb = self.prefill_shape(R, max(lens))
        flat = [t for p in prompts for t in (*p, *([0] * (Tb - len(p))))]
        flat += [0] * ((Rb - R) * Tb) + lens + [0] * (Rb - R) + host_rows + [self.scratch_row] * (Rb - R)
        packed = to_device(flat, self.device)                                    # one host-to-device copy
        ids, num, row_t = packed[:Rb * Tb].view(Rb, Tb), packed[Rb * Tb:Rb * Tb + Rb], packed[Rb * Tb + Rb:]
        if fresh:
            self.last_uploaded = UploadedPrompts(ids, row_t, torch.zeros_like(num), num, row_t[:R], num[:R])
        kv_len = self.attended_length(host_rows, Tb)
        if not fresh:   # appending (regenerate's history reuse): few attended lengths, so few graphs
            kv_len = min(self.size, self.kv_bucket * next_pow2(-(-kv_len // self.kv_bucket)))
        for r, n in zip(host_rows, lens):
            self._bound[r] = min(self._bound[r] + n, self.max_len)
        uses = self.prefill_shapes.use((Rb, Tb))
        self.last_prefill_shape = (Rb, Tb)
        key = ("prefill", Rb, Tb, kv_len, fresh)
        # an appending call's kernels differ from a fresh one's (masked SDPA over the cache): its own eager call is
        # its warm-up
        out = self.prefill_call(key, uses, fresh or key in self._append_warm, ids, num, row_t, kv_len, fresh=fresh)
        if self.use_graphs and not fresh and key not in self._graphs:
            self._append_warm.add(key)
        return out.logits[:R]

    def prefill_call(self, key: tuple, uses: int, warm: bool, ids, num_new, row_t, kv_len: int, *,
                     fresh: bool = False, start: torch.Tensor | None = None, head: bool = True) -> EngineOutput:
        """One prefill-shaped `_compute` (last tokens only) of the shape `key`, its `uses`-th call: replayed from
        the shape's CUDA graph, captured now if this is a later call of a `warm` shape (its first, eager call was
        the warm-up: no other) and `max_prefill_graphs` allows; else eager. A graph's output is a static buffer."""
        if self.use_graphs:
            entry = self._graphs.get(key)
            if entry is None and uses >= 2 and warm and self.prefill_graph_count < self.max_prefill_graphs:
                entry = self._graphs[key] = self._capture(ids, num_new, kv_len, True, row_t, warmups=0, fresh=fresh,
                                                          start=start, head=head)
                self.prefill_graph_count += 1
                log.info("captured prefill graph %d of at most %d: %s (%d x %d tokens, attended %d)",
                         self.prefill_graph_count, self.max_prefill_graphs, key[0], *ids.shape, kv_len)
            if entry is not None:
                graph, s_ids, s_num, out, s_rows, s_start = entry
                s_ids.copy_(ids)
                s_num.copy_(num_new)
                s_rows.copy_(row_t)
                if s_start is not None:
                    s_start.copy_(start)
                graph.replay()
                return out
        return self._compute(ids, num_new, row_t, kv_len, True, fresh=fresh, start=start, head=head)

    def _chunk_kernel(self) -> bool:
        """Whether chunked prefills attend through the per-row kernel (CUDA, bf16 / fp16, attention auto or rows)."""
        G = self.heads // self.kv_heads
        return self.ops.attention in ("auto", "rows") and row_kernel_supported(
            self.device, self.dtype, G * GROUPED_QUERY_MAX_T, self.head_dim)

    def _compute(self, ids, num_new, row_t, kv_len: int, last_only: bool, fresh: bool = False,
                 start: torch.Tensor | None = None, head: bool = True) -> EngineOutput:
        """One forward (module docstring). `fresh`: every row was empty (a prefill of new prompts, right-padded),
        so token t sees exactly the new tokens 0..t: plain causal attention over them, no cache read, no mask.
        `start` [B] (chunked prefill, chunked_prefill.py): row b's tokens go to positions start[b] .. of cache row
        row_t[b] (rows may repeat), attend over that cache row, and the lengths are left to the caller.
        head=False (with last_only): the last real token's features, not logits (`EngineOutput.last_hidden`)."""
        B, T = ids.shape
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        G = H // KVH
        ri = torch.arange(B, device=self.device) if row_t is None else row_t
        old = start if start is not None else self.lengths[:B] if row_t is None else self.lengths[row_t]
        pos = old[:, None] + torch.arange(T, device=self.device)                   # [B, T]
        write_pos = pos.clamp(max=self.size - 1)
        few = T <= GROUPED_QUERY_MAX_T
        mode = ("causal" if fresh and not few
                else "rows" if (start is not None and self._chunk_kernel()) or self.row_attention(B, T)
                else "explicit" if few and self.ops.explicit_attention(B, KVH) else "sdpa")
        mask = None
        if mode in ("explicit", "sdpa"):
            visible = torch.arange(kv_len, device=self.device)[None, None, :] <= pos[:, :, None]   # [B, T, kv]
            if few:
                mask = visible[:, None, None].expand(B, 1, G, T, kv_len).reshape(B, 1, G * T, kv_len)
            else:
                mask = visible[:, None]
        if mode == "explicit":
            mask = few_query_bias(mask, KVH, self.dtype)                             # [B*KVH, G*T, kv], additive
        x = self.embed(ids)
        cos, sin = self.rotary(x, pos)                                               # [B, T, D]
        rotary = cos, sin                                                            # fused_elementwise's inputs
        sin_signed = signed_sin(sin)                                                 # once per forward
        by_token = cos[:, :, None], sin_signed[:, :, None]                           # [B, T, 1, D]: q|k at once
        cos, sin_signed = cos[:, None], sin_signed[:, None]                          # [B, 1, T, D]: q, k apart
        captured = []
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self.ops.norm(layer.input_layernorm, x)
            qk_norm = getattr(attn, "q_norm", None) is not None                    # Qwen3
            joint = None if qk_norm else self.ops.project_qk_v(li, h)
            kc, vc = self.k_cache[li], self.v_cache[li]
            if joint is not None:       # q and k adjacent in the fused projection: rotated in one pass (3 kernels)
                qk, v = joint[0].view(B, T, H + KVH, D), joint[1].view(B, T, KVH, D)
                if mode == "rows" and fused_ok(qk):   # one kernel: rotation + cache writes (the kernel reads the cache)
                    q, k = rope_into_cache(qk, v, *rotary, H, kc, vc, ri, write_pos).transpose(1, 2), None
                else:
                    qk = rope_tokens(qk, *rotary) if fused_ok(qk) else rope(qk, *by_token)  # [B, T, H + KVH, D]
                    q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            else:
                q, k, v = self.ops.project_qkv(li, attn, h)
                q, k, v = q.view(B, T, H, D), k.view(B, T, KVH, D), v.view(B, T, KVH, D)
                if qk_norm:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                q, k = rope(q, cos, sin_signed), rope(k, cos, sin_signed)
            if k is not None:
                kc[ri[:, None], :, write_pos] = k.transpose(1, 2)
                vc[ri[:, None], :, write_pos] = v
            o = self._attend(q, (k, v), kc, vc, row_t, ri, old, kv_len, mask, mode, attn.scaling)
            o = o.reshape(B, T, H * D) if mode == "rows" else o.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
            x = x + self.ops.o[li](o)
            x = x + self.ops.mlp(li, layer.mlp, self.ops.norm(layer.post_attention_layernorm, x))
            if li in self.capture_layer_ids and li != last:
                captured.append(x)
        x = self.ops.norm(self.norm, x)
        if last in self.capture_layer_ids:
            captured.append(x)
        if start is not None:
            pass                                         # chunked prefill: the caller sets the rows' lengths
        elif row_t is None:
            self.lengths[:B] += num_new
        else:
            self.lengths[row_t] = old + num_new
        if last_only:
            at = (num_new - 1).clamp(min=0)
            x = x[torch.arange(B, device=self.device), at]
        hidden = torch.cat(captured, dim=-1) if captured else None
        if not head:
            return EngineOutput(None, hidden, x)
        return EngineOutput(self.ops.head(x), hidden)

    def _attend(self, q, new_kv, kc, vc, row_t, ri, old, kv_len: int, mask, mode: str, scale: float) -> torch.Tensor:
        """Attention of q [B, H, T, D] over one layer's cache rows (or, "causal", over the new keys / values
        [B, KVH, T, D] / [B, T, KVH, D] alone); [B, KVH, G*T, D], [B, H, T, D] or ("rows") [B, T, H, D]."""
        B, H, T, D = q.shape
        KVH = self.kv_heads
        G = H // KVH
        if mode == "causal":
            k, v = new_kv[0].repeat_interleave(G, dim=1), new_kv[1].transpose(1, 2).repeat_interleave(G, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if mode == "rows":
            return row_length_attention(q.transpose(1, 2), kc, vc, ri, old, kv_len, scale)   # strided: no copy
        if row_t is None:
            keys, vals = kc[:B, :, :kv_len], vc[:B, :, :kv_len]
        else:
            keys, vals = kc[row_t, :, :kv_len], vc[row_t, :, :kv_len]
        if mode == "explicit":
            return few_query_attention(q.reshape(B, KVH, G * T, D), keys, vals, mask, scale)
        if T <= GROUPED_QUERY_MAX_T:       # [B, KVH, G*T, D]: query heads of one KV head share its keys
            return F.scaled_dot_product_attention(q.reshape(B, KVH, G * T, D), keys, vals, attn_mask=mask, scale=scale)
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(G, dim=1), vals.repeat_interleave(G, dim=1),
                                              attn_mask=mask, scale=scale)

    # ------------------------------------------------------------------ CUDA graphs
    def _replay(self, ids, num_new, kv_len: int, last_only: bool) -> EngineOutput:
        key = (ids.shape[0], ids.shape[1], kv_len, last_only)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(ids, num_new, kv_len, last_only)
            self._graphs[key] = entry
        graph, s_ids, s_num, out, _, _ = entry
        s_ids.copy_(ids)
        s_num.copy_(num_new)
        graph.replay()
        return out

    def _capture(self, ids, num_new, kv_len: int, last_only: bool, row_t=None, warmups: int = 2, fresh: bool = False,
                 start=None, head: bool = True):
        """A CUDA graph of one `_compute` with static copies of its inputs: (graph, ids, num_new, output, rows,
        start); a replay reads whatever the caller copied into those."""
        s_ids, s_num = ids.clone(), num_new.clone()
        s_rows = None if row_t is None else row_t.clone()
        s_start = None if start is None else start.clone()
        saved = self.lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                    # warm-up (lazy inits); the lengths are put back
            for _ in range(warmups):
                self._compute(s_ids, s_num, s_rows, kv_len, last_only, fresh, s_start, head)
                self.lengths.copy_(saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._compute(s_ids, s_num, s_rows, kv_len, last_only, fresh, s_start, head)
        self.lengths.copy_(saved)                        # capture does not run kernels; belt and braces
        log.debug("captured a CUDA graph for (B, T, kv_len, last_only) = %s", (*ids.shape, kv_len, last_only))
        return graph, s_ids, s_num, out, s_rows, s_start

    @property
    def graph_count(self) -> int:
        return len(self._graphs)
