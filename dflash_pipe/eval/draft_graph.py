"""The DFlash drafting step at fixed shapes, replayed as CUDA graphs (eager on the CPU, same code).

`GraphedDFlashProposer` drafts exactly what `DFlashProposer` drafts (same drafter math, same mask),
with its state in buffers that live across generations, so a step is two graph replays and one
host read of the drafts:
  * context update, fixed width B: the context keys/values of feature rows [r, r + B) (r = first
    row not cached yet) are computed and written at those rows. Rows below the anchor p are final
    (p - r <= B after the first step, since a step commits at most B tokens); rows p..r+B-1 get
    non-final values, which the mask hides (a block sees kv < anchor) and the next update rewrites.
    The first update of a generation covers the whole prompt and runs eagerly;
  * block forward at an attended length L = p + 1 rounded up to `kv_bucket` (one graph per L):
    the drafter over cached rows [0, L) with the block [token p, MASK x (B-1)] anchored at p, then
    lm_head + argmax of slots 1..B-1.
The per-step inputs (r, p, token p and B feature rows) are copied into static tensors on the
device (fill_ / copy_, no host sync); graph outputs are static and read with one `.tolist()`.
With graphs, the drafter's linear layers (B rows) and the head (B - 1 rows) run the fp32 formulation
timed fastest for their shape (target/linear_choice.py; `F.linear` on the CPU).
`use_graphs='off'` (and any CPU run) executes the same two functions eagerly: that is what the CPU
tests compare with `DFlashProposer`.
"""

from __future__ import annotations

import torch

from ..drafter import AttentionMask
from ..target.linear_choice import LinearChooser
from ..target.small_batch_ops import ChosenLinear, choose_linear_forwards
from ..errors import UsageError
from .specdecode import DFlashProposer


class GraphedDFlashProposer(DFlashProposer):
    """`DFlashProposer` with persistent buffers and CUDA-graphed steps (module docstring)."""

    def __init__(self, drafter, cfg, embed_VH, lm_head, *, use_graphs: str = "auto", kv_bucket: int = 128,
                 max_rows: int = 2048, chooser: LinearChooser | None = None):
        if use_graphs not in ("auto", "on", "off"):
            raise UsageError(f"use_graphs must be auto, on or off, got {use_graphs!r}")
        super().__init__(drafter, cfg, embed_VH, lm_head)
        self.use_graphs = embed_VH.device.type == "cuda" and use_graphs != "off"
        self.kv_bucket = kv_bucket
        self.chooser, self._head = chooser, lm_head
        if self.use_graphs or chooser is not None:   # (a chooser given: tests drive the formulations on the CPU)
            self.chooser = chooser or LinearChooser(self.device)
            B = cfg.block_size                  # the drafter's linears run on B rows, the head on B - 1
            choose_linear_forwards(self.drafter, (B,), self.chooser)
            if type(lm_head) is torch.nn.Linear:
                self._head = ChosenLinear(lm_head.weight, lm_head.bias, self.chooser, (B - 1,), 1, {})
        self._alloc(max_rows, None)

    def _alloc(self, rows: int, feat_width: int | None) -> None:
        B, d = self.cfg.block_size, self.device
        self.max_rows = rows
        self._kvbuf: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # built by the first eager update
        self._feat_width = feat_width
        self.s_rows0 = torch.zeros(1, dtype=torch.long, device=d)
        self.s_anchor = torch.zeros(1, dtype=torch.long, device=d)
        self.s_ids = torch.full((B,), self.cfg.mask_token_id, dtype=torch.long, device=d)
        self.s_feats = None
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

    def reset(self) -> None:
        """A new generation: nothing cached (the buffers stay)."""
        self._rows = 0

    # ------------------------------------------------------------------ the two fixed-shape functions
    def _update(self) -> None:
        """Context k/v of rows [s_rows0, s_rows0 + B) from s_feats, written into the buffers."""
        B = self.cfg.block_size
        pos = self.s_rows0 + torch.arange(B, device=self.device)
        for (kb, vb), (k, v) in zip(self._kvbuf, self.drafter.context_kv(self.s_feats, pos)):
            kb.index_copy_(0, pos, k)
            vb.index_copy_(0, pos, v)

    def _block(self, L: int) -> torch.Tensor:
        """Draft token ids [B-1] of the block anchored at s_anchor over cached rows [0, L)."""
        B, d = self.cfg.block_size, self.device
        mask = AttentionMask(torch.zeros(L, dtype=torch.int32, device=d), self.s_anchor,
                             torch.zeros(1, dtype=torch.int32, device=d), torch.ones(1, dtype=torch.bool, device=d), B)
        blk_pos = self.s_anchor + torch.arange(B, device=d)
        hidden = self.drafter.forward_cached([(kb[:L], vb[:L]) for kb, vb in self._kvbuf], self.embed_VH[self.s_ids],
                                             blk_pos, mask)
        return self._head(hidden[1:].to(self.lm_head.weight.dtype)).argmax(dim=-1)

    # ------------------------------------------------------------------ graphs
    def _run(self, key, fn):
        if not self.use_graphs:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):               # warm-up; both functions are idempotent at fixed inputs
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = fn()
            entry = self._graphs[key] = (graph, out)
        entry[0].replay()
        return entry[1]

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ one step
    def _ensure(self, features: torch.Tensor) -> None:
        rows, width = features.shape
        if rows > self.max_rows or (self._feat_width is not None and width != self._feat_width):
            self._alloc(max(rows, 2 * self.max_rows), width)
        if self._kvbuf is None:
            probe = self.drafter.context_kv(features[:1], torch.zeros(1, dtype=torch.long, device=self.device))
            self._kvbuf = [(k.new_zeros((self.max_rows + self.cfg.block_size, *k.shape[1:])),
                            v.new_zeros((self.max_rows + self.cfg.block_size, *v.shape[1:]))) for k, v in probe]
            self._feat_width = width
            self.s_feats = features.new_zeros((self.cfg.block_size, width))

    @torch.inference_mode()
    def propose(self, tokens: list[int], features: torch.Tensor | None, num: int) -> list[int]:
        if num <= 0:
            return []
        p, B = self._anchor(tokens), self.cfg.block_size
        self._ensure(features)
        if p < self._rows:
            self.reset()                                  # not the generation the buffers were filled for
        if p - self._rows > B:                            # the prompt (first step): eager, any width
            pos = torch.arange(self._rows, p, device=self.device)
            for (kb, vb), (k, v) in zip(self._kvbuf, self.drafter.context_kv(features[self._rows:p], pos)):
                kb[self._rows:p], vb[self._rows:p] = k, v
            self._rows = p
        if self._rows < p:
            r = self._rows
            self.s_rows0.fill_(r)
            n = min(B, features.shape[0] - r)             # rows past p: stale but finite, masked, rewritten later
            self.s_feats[:n].copy_(features[r:r + n])
            self._run(("update",), self._update)
            self._rows = p
        L = min(self.max_rows + B, -(-(p + 1) // self.kv_bucket) * self.kv_bucket)
        self.s_anchor.fill_(p)
        self.s_ids[0].fill_(tokens[-1])
        drafts = self._run(("block", L), lambda: self._block(L))
        return drafts[:num].tolist()
