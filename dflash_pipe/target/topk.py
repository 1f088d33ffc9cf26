"""Top-k next-token log-probs of the LM head, one [chunk, V] block of logits at a time.

Per block (V = 248,320 at the Qwen3.5 shape; a 2048-token block of bf16 logits is 1 GB):

  * the logits come out of lm_head in the model dtype, exactly like the HF forward (an optional
    final-logit softcap is applied in that dtype too);
  * the top-k runs on them in that dtype (`segmented_topk`: two small stages with the values of
    `torch.topk`). bf16/fp16 -> fp32 is exact, so the selected values are bit-identical to a top-k
    of the fp32 copy; only the order among exactly tied logits may differ (unspecified in both);
  * the normaliser is a logsumexp with fp32 accumulation. On CUDA it is a small function
    compiled by inductor (`dynamic=True`: the shorter last block does not recompile) whose fused
    reduction reads the bf16 block at most twice (max, then sum of exp, cast fused into the loads)
    and writes one float per row, so no fp32 [chunk, V] copy is materialised. The eager fallback
    (CPU, `set_compiled_logsumexp(False)`, or when compiling fails) is `torch.logsumexp` of the
    fp32 block, in row groups of <= 256 MB on CUDA;
  * log p = logit - logsumexp is formed in fp32 and stored as fp16.

The former path (fp32 copy + eager logsumexp, ~5 passes over it + fp32 top-k) cost ~30-40 ms
of GPU time per 8k-token batch at the 27B shape (H200 profile). With this path (and the removed
host syncs, landed together) the GPU side of extraction went from 0.952 to 0.967 of forward-only
(BENCHMARKS.md, session 3; different runs). The two-stage top-k then cut the top-k of a block
from 3.61 to 1.17 ms on the H200 (session 4, bench/topk_kernel.py).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dflash_pipe.target")

_EAGER_BLOCK_BYTES = 256 << 20


def logsumexp_f32(logits: torch.Tensor) -> torch.Tensor:
    """[n, V] logits of any float dtype -> [n, 1] float32 logsumexp (fp32 accumulation)."""
    return torch.logsumexp(logits.float(), dim=-1, keepdim=True)


_COMPILE = {"on": True, "failed": False, "fn": None}


def compiled_logsumexp_fn():
    """`logsumexp_f32` under torch.compile(dynamic=True), built on first use (importing dynamo is slow)."""
    if _COMPILE["fn"] is None:
        _COMPILE["fn"] = torch.compile(logsumexp_f32, dynamic=True)
    return _COMPILE["fn"]


def set_compiled_logsumexp(enabled: bool) -> None:
    """Use the compiled logsumexp on CUDA (default) or always the eager one (debugging, comparisons)."""
    _COMPILE["on"] = bool(enabled)


def compiled_logsumexp_active() -> bool:
    """Whether CUDA blocks currently go through the compiled reduction (False after a compile failure)."""
    return _COMPILE["on"] and not _COMPILE["failed"]


def _logsumexp_eager(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype == torch.float32 or not logits.is_cuda:
        return logsumexp_f32(logits)
    rows = max(1, _EAGER_BLOCK_BYTES // (4 * max(1, logits.shape[-1])))
    return torch.cat([logsumexp_f32(logits[i:i + rows]) for i in range(0, logits.shape[0], rows)])


def row_logsumexp(logits: torch.Tensor, compiled: bool | None = None) -> torch.Tensor:
    """[n, V] -> [n, 1] fp32 logsumexp. compiled=None: the compiled reduction on CUDA, eager elsewhere;
    True/False force it (True on a CPU runs inductor's C++ backend: tests)."""
    use = (logits.is_cuda and compiled_logsumexp_active()) if compiled is None else compiled
    if use:
        try:
            return compiled_logsumexp_fn()(logits)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # no triton / no C++ compiler / an inductor bug: stay correct, get slower
            if compiled:
                raise
            _COMPILE["failed"] = True
            log.warning("compiled logsumexp unavailable (%r); the top-k normaliser falls back to eager fp32 "
                        "(an fp32 copy of every logits block)", exc)
    return _logsumexp_eager(logits)


SEGMENT = 512  # vocab columns per segment of the two-stage top-k (248,320 = 485 x 512)


def segmented_topk(logits: torch.Tensor, k: int, segment: int = SEGMENT) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, k, dim=-1)` of an [n, V] block in two small stages; same values, sorted.

    Stage 1 takes the max of every full `segment` of columns ([n, V // segment], one read of the
    block) and the k segments with the largest maxima; stage 2 is a top-k over those k x segment
    columns plus the < segment columns past the last full segment. Exact: let v be the k-th largest
    value among the full segments' columns. An element above v lies in a segment whose max is above
    v; fewer than k segments have such a max, so all are chosen. Each chosen segment whose max
    equals v holds at least one v, and at least k - #(elements > v) of them are chosen, or else
    every segment holding a v is. So the chosen segments hold the top-k multiset of the full part,
    and with the tail columns that of the row. Only the order among exactly tied values can differ
    from torch.topk's (unspecified in both).

    torch.topk's radix select passes over the whole [n, V] block several times; this reads it once
    plus k x segment gathered columns per row (bench/topk_kernel.py times both on the GPU).
    """
    n, V = logits.shape
    full = V // segment
    if k > full or 4 * k * segment > V:   # too few segments to pay off: the plain top-k
        return torch.topk(logits, k, dim=-1)
    seg_max = logits[:, :full * segment].view(n, full, segment).amax(dim=-1)              # [n, full]
    seg_ids = torch.topk(seg_max, k, dim=-1).indices                                       # [n, k]
    cols = (seg_ids[:, :, None] * segment + torch.arange(segment, device=logits.device)).view(n, -1)
    if V > full * segment:
        tail = torch.arange(full * segment, V, device=logits.device).expand(n, -1)
        cols = torch.cat([cols, tail], dim=1)
    vals, pos = torch.topk(torch.gather(logits, 1, cols), k, dim=-1)
    return vals, torch.gather(cols, 1, pos)


def topk_logprobs_block(logits: torch.Tensor, k: int, compiled: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and log-probs (fp16) of log_softmax over the last dim of one logits block."""
    lse = row_logsumexp(logits, compiled)
    vals, idx = segmented_topk(logits, k)
    return idx.to(torch.int32), (vals.float() - lse).to(torch.float16)


def chunked_topk_logprobs(final_hidden_TH: torch.Tensor, lm_head, k: int, chunk: int,
                          softcap: float | None = None, compiled: bool | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and log-probs (fp16) of log_softmax(lm_head(h)), `chunk` tokens at a time.

    Only one [chunk, V] block of logits exists at a time (V = 248,320 makes the whole-row
    fp32 logits of 8k tokens 8 GB); see the module docstring for the per-block arithmetic.
    """
    T = final_hidden_TH.shape[0]
    device = final_hidden_TH.device
    ids_out = torch.empty((T, k), dtype=torch.int32, device=device)
    lp_out = torch.empty((T, k), dtype=torch.float16, device=device)
    for s in range(0, T, chunk):
        logits = lm_head(final_hidden_TH[s:s + chunk])
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        ids, lp = topk_logprobs_block(logits, k, compiled)
        ids_out[s:s + chunk] = ids
        lp_out[s:s + chunk] = lp
        del logits, ids, lp
    return ids_out, lp_out
