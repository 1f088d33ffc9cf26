"""Chunked prefill: fresh prompts cut into 16-token chunks, one verify-shaped forward for all of them.

The padded prefill (`StaticKVEngine.prefill` with ``prefill_layout="padded"``) runs R prompts as one
[row bucket, length bucket] call: every prompt is padded to the call's longest, and the rows to a power of
two. On regenerate's ShareGPT first turns 44 % of the tokens it computed were padding (session 25, H100).

Here prompt i is cut into ceil(len_i / 16) chunks; chunk j is one row of a T = 16 forward whose tokens sit at
positions 16 j .. 16 j + 15 of the prompt's cache row (`_compute(start=...)`). Each layer writes the K/V of
every chunk first and attends afterwards, each query t of a chunk starting at s over keys 0 .. s + t of its
cache row: the per-row attention kernel on CUDA (decode_attention.py: it reads only those keys), a masked
SDPA over the row elsewhere. That is causal attention over the prompt alone, as if it were prefilled by
itself, so a prompt's padding is its last chunk's remainder (at most 15 tokens) and the call's is the chunk
bucket's (`chunk_bucket`: four buckets per octave). The remainder's K/V land past the prompt, where the
decode overwrites them and no query of the prompt looks.

The call's output is each chunk's last real token's features; the head runs on the R prompts' last chunks
only. With CUDA graphs a chunk bucket's first call runs eagerly (its warm-up) and its second one captures a
graph (ids, rows, starts and counts in static inputs), replayed from then on, within the engine's
`max_prefill_graphs`; the attended length is then the whole row (the kernel stops at each chunk's own end
anyway; the masked SDPA of fp32 reads the row), so a chunk bucket is one graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .prefill_shapes import row_bucket
from .runner_utils import to_device

CHUNK = 16                         # tokens per chunk: the engine's largest verify shape (GROUPED_QUERY_MAX_T)
BUCKETS_PER_OCTAVE = 4             # chunk counts are padded to p/2 + k p/8 (p the next power of two)


class UploadedPrompts(NamedTuple):
    """A fresh prefill's prompt tokens as they went to the device (`StaticKVEngine.last_uploaded`), for callers
    that keep a copy of each row's tokens (regenerate's lookup drafts) without a second upload: piece i holds the
    counts[i] tokens ids[i, :counts[i]] of the prompt in cache row rows[i] from position starts[i] (a chunk, or a
    whole padded prompt; padding pieces count 0); prompt j is in row prompt_rows[j], prompt_lens[j] tokens long."""
    ids: torch.Tensor            # [pieces, width]
    rows: torch.Tensor           # [pieces] (padding pieces: the engine's scratch row)
    starts: torch.Tensor         # [pieces]
    counts: torch.Tensor         # [pieces]
    prompt_rows: torch.Tensor    # [prompts]
    prompt_lens: torch.Tensor    # [prompts]


def chunk_count(n_tokens: int) -> int:
    """Chunks of a prompt of `n_tokens` tokens."""
    return -(-n_tokens // CHUNK)


def chunk_bucket(n_chunks: int, min_chunks: int = 8) -> int:
    """The padded chunk count of a call of `n_chunks` chunks (one CUDA graph per bucket)."""
    return row_bucket(n_chunks, min_chunks, BUCKETS_PER_OCTAVE)


def chunk_layout(prompts: Sequence[Sequence[int]], rows: Sequence[int], n_chunks: int, pad_row: int):
    """The call's host-side inputs, padded to `n_chunks` chunks: (ids [n_chunks * 16], the cache row, start
    position and real token count of each chunk, the index of each prompt's last chunk). Padding chunks write
    to `pad_row` and have no real token."""
    ids: list[int] = []
    chunk_rows: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    last: list[int] = []
    for p, r in zip(prompts, rows):
        for s in range(0, len(p), CHUNK):
            piece = p[s:s + CHUNK]
            ids.extend(piece)
            ids.extend([0] * (CHUNK - len(piece)))
            chunk_rows.append(r)
            starts.append(s)
            counts.append(len(piece))
        last.append(len(chunk_rows) - 1)
    pad = n_chunks - len(chunk_rows)
    if pad < 0:
        raise ValueError(f"chunk_layout: {len(chunk_rows)} chunks do not fit {n_chunks}")
    ids.extend([0] * (pad * CHUNK))
    chunk_rows.extend([pad_row] * pad)
    starts.extend([0] * pad)
    counts.extend([0] * pad)
    return ids, chunk_rows, starts, counts, last


@torch.inference_mode()
def chunked_prefill(engine, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
    """Prefill each prompt into its (empty) row of `engine` (a StaticKVEngine made with bucketed_prefill) as
    16-token chunks (module docstring); the logits at each prompt's last token, [R, V] (a new tensor)."""
    R = len(prompts)
    lens = [len(p) for p in prompts]
    C = sum(chunk_count(n) for n in lens)
    Cb = chunk_bucket(C, engine.prefill_min_rows) if engine.use_graphs else C
    ids, chunk_rows, starts, counts, last = chunk_layout(prompts, rows, Cb, engine.scratch_row)
    packed = to_device(ids + chunk_rows + starts + counts + last + list(rows) + lens,
                       engine.device)                                          # one host-to-device copy
    n = Cb * CHUNK
    ids_t = packed[:n].view(Cb, CHUNK)
    rows_t, starts_t, counts_t = packed[n:n + Cb], packed[n + Cb:n + 2 * Cb], packed[n + 2 * Cb:n + 3 * Cb]
    tail = packed[n + 3 * Cb:]
    last_t, prompt_rows, prompt_lens = tail[:R], tail[R:2 * R], tail[2 * R:]
    if engine.use_graphs:
        kv_len = engine.size            # one graph per bucket (the kernel stops at each chunk's end anyway)
    else:
        kv_len = min(engine.size, -(-(chunk_count(max(lens)) * CHUNK) // engine.kv_bucket) * engine.kv_bucket)
    uses = engine.prefill_shapes.use((Cb, CHUNK))
    engine.last_prefill_shape = (Cb, CHUNK)
    engine.last_uploaded = UploadedPrompts(ids_t, rows_t, starts_t, counts_t, prompt_rows, prompt_lens)
    out = engine.prefill_call(("chunks", Cb, kv_len), uses, True, ids_t, counts_t, rows_t, kv_len, start=starts_t,
                              head=False)
    features = out.last_hidden[last_t]                                         # [R, H], a copy
    engine.lengths[prompt_rows] = prompt_lens
    for r, m in zip(rows, lens):
        engine._bound[r] = min(m, engine.max_len)
    return engine.ops.head(features)
