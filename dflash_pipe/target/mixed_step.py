"""A decode step that prefills new prompts on the way: regenerate's "mixed" prefill layout.

A separate prefill call pays a decode step's fixed costs a second time. At SmolLM2-135M's size a batch-1,024 decode
step is mostly latency: ~600 kernels, most of them elementwise over a few MB, and GEMMs 576 wide that leave SMs
idle. A chunked prefill call of ~4 k tokens cost ~6 ms on the H100, a decode step ~4.1 ms (BENCHMARKS.md,
session 30). `decode_with_prefill` runs one step of the decode rows and the refill's prompts together:

* the prompts are cut into 16-token chunks as in chunked_prefill.py (`chunk_layout`);
* the B decode tokens and the C x 16 chunk tokens go through the norms, projections, RoPE and MLPs as one batch
  of B + 16 C tokens;
* each layer writes the decode rows' K/V, then the chunks' K/V. A refilled row is inactive in the step, so its
  decode write lands at position 0, and the chunk's own write there comes later and wins;
* each layer then attends twice. The decode rows attend over their own keys (T = 1), as `forward` does. The
  chunks attend over their cache rows up to their own positions (T = 16), as the chunked prefill does.

Out come the decode rows' logits and each prompt's last-token logits, with every row's length and K/V as after
`prefill(prompts, rows)` followed by `forward(ids, num_new)`: the same math. Only the GEMMs' rounding differs, as it
does between any two call shapes. The refilled rows take their first token from the prompt logits and decode from
the next step on: one step later than after a separate prefill call.

With CUDA graphs a chunk bucket's first call runs eagerly (its warm-up) and its second call captures a graph,
replayed from then on. Graphs count against the engine's `max_prefill_graphs`, and past that limit calls run
eagerly. Both attentions then read up to the whole row, which the per-row kernel bounds by each row's own length
anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UsageError
from .chunked_prefill import CHUNK, chunk_bucket, chunk_count, chunk_layout
from .runner_utils import to_device


@torch.inference_mode()
def decode_with_prefill(engine, ids: torch.Tensor, num_new: torch.Tensor, prompts: Sequence[Sequence[int]],
                        rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of rows 0..B-1 of `engine` (a StaticKVEngine made with bucketed_prefill): ids [B, 1] and
    num_new [B] as `engine.forward` takes them. It also prefills prompt i into the empty row rows[i] < B, whose
    num_new must be 0. Returns (logits [B, 1, V], a static buffer with CUDA graphs; the prompts' last-token
    logits [R, V])."""
    B = ids.shape[0]
    host_rows = [int(r) for r in rows]
    lens = [len(p) for p in prompts]
    R = len(prompts)
    if not engine.bucketed_prefill or engine.capture_layer_ids:
        raise UsageError("decode_with_prefill needs an engine made with bucketed_prefill and no captured layers")
    if ids.shape != (B, 1) or B > engine.max_batch:
        raise UsageError(f"decode_with_prefill: ids of shape {tuple(ids.shape)} for a {engine.max_batch}-row cache")
    if (R < 1 or len(host_rows) != R or len(set(host_rows)) != R or any(not 0 <= r < B for r in host_rows)
            or any(engine._bound[r] for r in host_rows)):
        raise UsageError(f"decode_with_prefill: {R} prompts for rows {host_rows[:8]}...: one distinct empty row "
                         f"among the step's {B} each")
    if min(lens) < 1 or max(lens) > engine.max_len:
        raise UsageError(f"decode_with_prefill: prompt lengths {min(lens)}..{max(lens)} outside 1..{engine.max_len}")
    C = sum(chunk_count(n) for n in lens)
    Cb = chunk_bucket(C, engine.prefill_min_rows) if engine.use_graphs else C
    c_ids, c_rows, starts, counts, last = chunk_layout(prompts, host_rows, Cb, engine.scratch_row)
    packed = to_device(torch.tensor(c_ids + c_rows + starts + counts + last + host_rows + lens, dtype=torch.long),
                       engine.device)                                           # one host-to-device copy
    n = Cb * CHUNK
    c_ids_t = packed[:n].view(Cb, CHUNK)
    c_rows_t, starts_t, counts_t = packed[n:n + Cb], packed[n + Cb:n + 2 * Cb], packed[n + 2 * Cb:n + 3 * Cb]
    tail = packed[n + 3 * Cb:]
    last_t, prompt_rows, prompt_lens = tail[:R], tail[R:2 * R], tail[2 * R:]
    if engine.use_graphs:
        kv_len = engine.size
    else:
        need = max(max(engine._bound[:B]) + 1, chunk_count(max(lens)) * CHUNK)
        kv_len = min(engine.size, -(-need // engine.kv_bucket) * engine.kv_bucket)
    for r in range(B):
        engine._bound[r] = min(engine._bound[r] + 1, engine.max_len)
    num_new = to_device(num_new.long(), engine.device)
    inputs = (to_device(ids.long(), engine.device), num_new, c_ids_t, c_rows_t, starts_t, counts_t)
    engine.last_prefill_shape = (Cb, CHUNK)
    logits, feats = _run(engine, ("mixed", B, Cb), inputs, kv_len)
    first = engine.ops.head(feats[last_t])                                       # [R, V]
    engine.lengths[prompt_rows] = prompt_lens
    for r, m in zip(host_rows, lens):
        engine._bound[r] = m
    return logits, first


def _run(engine, key: tuple, inputs: tuple, kv_len: int):
    """`mixed_compute` of `inputs`: replayed from the key's CUDA graph, captured on the key's second call (the
    first one, eager, was its warm-up) while `max_prefill_graphs` allows; else eager."""
    if engine.use_graphs:
        entry = engine._graphs.get(key)
        uses = engine._mixed_uses[key] = engine._mixed_uses.get(key, 0) + 1
        if entry is None and uses >= 2 and engine.prefill_graph_count < engine.max_prefill_graphs:
            static = tuple(t.clone() for t in inputs)
            graph, out = engine.graphed(lambda: mixed_compute(engine, *static, kv_len))
            entry = engine._graphs[key] = (graph, static, out)
            engine.prefill_graph_count += 1
        if entry is not None:
            graph, static, out = entry
            for s, t in zip(static, inputs):
                s.copy_(t)
            graph.replay()
            return out
    return mixed_compute(engine, *inputs, kv_len)


def mixed_compute(engine, ids, num_new, c_ids, c_rows, starts, counts, kv_len: int):
    """The forward of the module docstring: (decode logits [B, 1, V], each chunk's last real token's features
    [C, hidden] after the final norm). Decode lengths grow by num_new; the caller sets the prompts' lengths."""
    B, C, T = ids.shape[0], c_ids.shape[0], CHUNK
    H, KVH, D = engine.heads, engine.kv_heads, engine.head_dim
    dev = engine.device
    old_d = engine.lengths[:B]
    pos_d = old_d[:, None]                                                     # [B, 1]
    pos_c = starts[:, None] + torch.arange(T, device=dev)                      # [C, 16]
    wp_d, wp_c = pos_d.clamp(max=engine.size - 1), pos_c.clamp(max=engine.size - 1)
    rows_d = torch.arange(B, device=dev)
    mode_d = engine._attention_mode(B, 1, False, False)
    mode_c = engine._attention_mode(C, T, False, True)
    mask_d, mask_c = engine._mask(pos_d, kv_len, mode_d), engine._mask(pos_c, kv_len, mode_c)
    x = engine.embed(torch.cat([ids.reshape(-1), c_ids.reshape(-1)]))[:, None]   # [B + 16 C, 1, hidden]
    rot = engine._rotation(x, torch.cat([pos_d.reshape(-1), pos_c.reshape(-1)])[:, None])
    for li, layer in enumerate(engine.layers):
        q, k, v = engine._qkv(li, layer, x, rot)           # one token per "row": [N, H, 1, D], [N, KVH, 1, D], [N, 1, KVH, D]
        kc, vc = engine.k_cache[li], engine.v_cache[li]
        k_d, v_d = k[:B], v[:B]
        k_c, v_c = k[B:].reshape(C, T, KVH, D), v[B:].reshape(C, T, KVH, D)
        kc[rows_d[:, None], :, wp_d] = k_d.transpose(1, 2)                      # decode rows first,
        vc[rows_d[:, None], :, wp_d] = v_d
        kc[c_rows[:, None], :, wp_c] = k_c                                      # then the chunks (they win)
        vc[c_rows[:, None], :, wp_c] = v_c
        scale = layer.self_attn.scaling
        o_d = engine._attend(q[:B], (k_d, v_d), kc, vc, None, rows_d, old_d, kv_len, mask_d, mode_d, scale)
        q_c = q[B:].reshape(C, T, H, D).transpose(1, 2)
        o_c = engine._attend(q_c, None, kc, vc, c_rows, c_rows, starts, kv_len, mask_c, mode_c, scale)
        o = torch.cat([o_d.reshape(B, H * D), o_c.reshape(C, H, T, D).transpose(1, 2).reshape(C * T, H * D)])
        x = engine._finish_layer(li, layer, x, o[:, None])
    x = engine.ops.norm(engine.norm, x[:, 0])                                   # [N, hidden]
    engine.lengths[:B] += num_new
    at = torch.arange(C, device=dev) * T + (counts - 1).clamp(min=0)
    return engine.ops.head(x[:B, None]), x[B:][at]
