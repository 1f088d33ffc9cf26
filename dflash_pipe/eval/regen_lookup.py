"""Prompt-lookup speculation in regenerate's engine backend (`--lookup-draft K`, `EngineBackend(lookup_draft=K)`).

A plain decode step feeds every live row its last chosen token and chooses one more. With lookup speculation a
step feeds the last chosen token plus K tokens drafted from the row's own history (its prompt and its answer so
far): the tokens that followed the latest earlier occurrence of the history's last 3 tokens (else its last 2,
else its last 1; no occurrence: the last token repeated), or, where it holds a longer match, from the n-gram
table all rows share (`shared`, on by default: regen_ngram_table.py). One forward of K + 1 tokens a row gives
the logits at each of the K + 1 positions; the choice at each is made exactly as a plain step makes it
(`regen_sampling.next_tokens` with the answer's key and that position's token index), and the row keeps the
drafts up to the first one that differs from the choice at its position, plus the choice there: 1 to K + 1 tokens
a step, cut at EOS and at max_new_tokens. The K / V of the rejected drafts stay in the cache past the row's length
(its length is moved back), where the next step overwrites them.

So the answers are the plain decode's (exact-match acceptance; sampled answers too, since a choice depends only
on the logits, the key and the token index), up to the rounding of a (K + 1)-token forward against one-token
ones. Everything stays on the device: drafting is a few element-wise ops over the `[rows, max_len]` history, so a
step needs no host sync, like a plain one.

Why: a target like SmolLM2-135M repeats itself and its prompts. `bench/lookup_sim.py` (106 of its greedy ShareGPT
answers, CPU) keeps 1.67 tokens a row-step at K = 2 and 1.80 at K = 3; on the H100 run's 13,829 answers K = 2 kept
1.72. A step of K + 1 tokens costs more than a one-token step but less than K + 1 of them: at batch 1,024 the
one-token step mostly reads the K / V cache, which the per-row attention kernel reads once for all K + 1 queries of
a row (a K = 2 step cost 1.43x a plain one there: 1.14-1.20x regenerate; BENCHMARKS.md, session 33).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UsageError
from ..target.chunked_prefill import UploadedPrompts
from ..target.runner_utils import to_device
from ..target.static_forward import GROUPED_QUERY_MAX_T
from .regen_ngram_table import SharedNgrams, SharedNgramsReference, table_size
from .regen_sampling import Decoding, next_tokens

NGRAMS = (3, 2, 1)          # the history's last n tokens looked up, longest first
AUTO_K = 2                  # the default where it pays (auto_lookup); BENCHMARKS.md, session 33


def check_lookup(k: int | None, overlap: bool = False, compact: bool = False) -> int | None:
    """None (auto) or K in 0..15; an explicit K > 0 refuses --overlap-prefill / --compact-tail."""
    if k is not None and not 0 <= k < GROUPED_QUERY_MAX_T:
        raise UsageError(f"--lookup-draft must be -1 (auto), 0 (off) or a draft count up to {GROUPED_QUERY_MAX_T - 1}, "
                         f"got {k}", "2 paid best on SmolLM2-135M (eval/regen_lookup.py)")
    if k and (overlap or compact):
        raise UsageError(f"--lookup-draft {k} keeps each row's token history in its slot: not with "
                         f"{'--overlap-prefill' if overlap else '--compact-tail'}", "drop one of them")
    return k


def auto_lookup(k: int | None, graphs: bool, dec: Decoding, overlap: bool, compact: bool) -> int:
    """K for --lookup-draft auto (None): AUTO_K on CUDA graphs for greedy answers without --overlap-prefill /
    --compact-tail, else 0. Measured on the H100 (SmolLM2-135M, greedy, batch 1,024): K = 2 1.196x (graphed step) and
    1.058x (eager), K = 3 1.124x; with the shared table K = 2 1.228x, K = 3 0.977x of K = 2 (session 34); on the CPU
    a step is compute-bound, so K + 1 tokens cost K + 1 times as much; sampled answers (temperature 0.7) keep 1.46
    tokens a row-step and their steps sample K + 1 times the logits: K = 2 0.859x plain steps (session 35)."""
    if k is not None:
        return k
    return AUTO_K if graphs and dec.greedy and not (overlap or compact) else 0


def draft_reference(history: Sequence[int], k: int, ngrams: Sequence[int] = NGRAMS,
                    shared: SharedNgramsReference | None = None) -> list[int]:
    """The K drafts of one row in plain Python (tests, bench/lookup_sim.py): what followed the latest earlier
    occurrence of the last n tokens, longest n first; with `shared`, the shared table's tokens where it holds a
    longer n-gram than the history; the last token repeated when neither has one; positions past the history are
    padding (None)."""
    h = list(history)
    n_sh, got_sh = shared.lookup(h) if shared is not None else (0, None)
    for n in ngrams:
        if len(h) <= n:
            continue
        tail = h[-n:]
        for j in range(len(h) - n - 1, -1, -1):
            if h[j:j + n] == tail:
                if n_sh > n:
                    return list(got_sh)
                got = h[j + n:j + n + k]
                return got + [None] * (k - len(got))
    return list(got_sh) if n_sh else [h[-1]] * k


class LookupDrafts:
    """Per-row token history on the device, the drafts drawn from it, and the speculative step (module
    docstring)."""

    def __init__(self, batch: int, max_len: int, k: int, device: torch.device, shared: bool = True):
        self.k, self.T = k, k + 1
        # the n-gram table all rows share (regen_ngram_table.py); None: each row's own history only
        self.table = SharedNgrams(k, table_size(batch, max_len), device) if shared else None
        self.spare = max_len                        # a column past every real position: writes that don't count
        with torch.inference_mode():
            self.hist = torch.zeros((batch, max_len + 1), dtype=torch.long, device=device)
            self.hlen = torch.zeros(batch, dtype=torch.long, device=device)   # prompt + tokens chosen so far
            self.cols = torch.arange(max_len + 1, device=device)
            self.ar_T = torch.arange(self.T, device=device)
            self.kept = torch.zeros((), dtype=torch.long, device=device)      # tokens kept, summed over steps
            self.drafted_rows = torch.zeros((), dtype=torch.long, device=device)   # live rows a lookup found
            self.shared_rows = torch.zeros((), dtype=torch.long, device=device)    # ... in the shared table
            self.ngram_of = torch.tensor(NGRAMS[::-1], device=device)   # a score's n-gram length, by score // L
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}     # CUDA: the whole step per (rows, greedy)
        self._warm: dict[tuple, int] = {}

    def fill(self, rows: torch.Tensor, prompts: Sequence[Sequence[int]], first: torch.Tensor,
             uploaded: UploadedPrompts | None = None) -> None:
        """Rows freshly prefilled with `prompts`, their first tokens `first`: the history starts as prompt + first.
        From the prefill's own upload where given (one scatter on the device; the host builds nothing: this runs
        between a launch's end and the next launch), else one host-to-device copy of the prompts."""
        if uploaded is not None:
            up = uploaded
            at = torch.arange(up.ids.shape[1], device=up.ids.device)[None]
            col = torch.where(at < up.counts[:, None], up.starts[:, None] + at, self.spare)
            row = up.rows.clamp(max=self.hist.shape[0] - 1)[:, None].expand_as(col)   # padding: the spare column
            self.hist.index_put_((row, col), up.ids)
            self.hist[up.prompt_rows, up.prompt_lens] = first
            self.hlen[up.prompt_rows] = up.prompt_lens + 1
            return
        P = max(len(p) for p in prompts)
        flat = [t for p in prompts for t in (*p, *([0] * (P - len(p))))] + [len(p) for p in prompts]
        packed = to_device(flat, self.hist.device)                      # pinned, async: no host sync
        ids, lens = packed[:-len(prompts)].view(len(prompts), P), packed[-len(prompts):]
        self.hist[rows, :P] = ids
        self.hist[rows, lens] = first
        self.hlen[rows] = lens + 1

    def draft(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K drafts of rows 0..w-1 ([w, K], long), `draft_reference` for every row at once, and where they came
        from ([w], long: 0 nowhere, 1 the row's own history, 2 the shared table)."""
        h, last = self.hist[:w], (self.hlen[:w] - 1).clamp(min=0)   # where the row's last token sits (0: empty row)
        cols = self.cols
        score = torch.full_like(h, -1)
        match = cols[None] < last[:, None]                      # an earlier occurrence ends before the last token
        L = h.shape[1]
        for i in range(max(NGRAMS)):
            ti = h.gather(1, (last - i).clamp(min=0)[:, None])  # the history's i-th token from the end
            same = torch.zeros_like(match)
            same[:, i:] = h[:, :L - i] == ti                    # ends e with h[e - i] == ti
            match = match & same & (last[:, None] >= i)
            n = i + 1
            if n in NGRAMS:                                     # longer matches rank above shorter ones
                score = torch.where(match, cols[None] + NGRAMS[::-1].index(n) * L, score)
        best = score.max(dim=1).values
        found = best >= 0
        start = best % L + 1
        idx = (start[:, None] + self.ar_T[:self.k]).clamp(max=L - 1)
        drafts = torch.where(found[:, None], h.gather(1, idx), h.gather(1, last[:, None]))
        source = found.long()
        if self.table is not None:                              # a longer n-gram in the shared table wins
            n_own = torch.where(found, self.ngram_of[(best // L).clamp(min=0)], 0)
            n_sh, shared = self.table.lookup(h, last)
            use = n_sh > n_own
            drafts = torch.where(use[:, None], shared, drafts)
            source = torch.where(use, 2, source)
        return drafts, source

    def step(self, be, w: int, dec: Decoding) -> None:
        """One speculative step of backend `be` on its first `w` rows. With CUDA graphs the whole step (drafts,
        forward, choices, bookkeeping: ~60 kernels besides the forward's) is one graph per (w, greedy or not):
        every input is a persistent buffer, so a replay needs no copies. A key's first two steps run eagerly (the
        warm-up: kernel choice, lazy inits), its third is captured and replayed. Its forward attends over the
        whole cache width (`kv_len` = the engine's size: the per-row kernel reads each row's own keys anyway), and
        the host's length bounds of the rows go to max_len (any row may have grown by T)."""
        eng = be.engine
        if not eng.use_graphs:
            return self._step(be, w, dec, graphed=False)
        eng.widen_bounds(w)
        key = (w, dec.greedy)
        graph = self._graphs.get(key)
        if graph is None:
            self._warm[key] = self._warm.get(key, 0) + 1
            if self._warm[key] <= 2:
                return self._step(be, w, dec, graphed=True)
            graph = self._graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=eng.graph_pool):  # shared with the engine's graphs: never concurrent
                self._step(be, w, dec, graphed=True)
        graph.replay()

    def _step(self, be, w: int, dec: Decoding, graphed: bool) -> None:
        """The step itself (the plain one is `EngineBackend._decode` + `_advance`): feed, choose at every position,
        keep the agreeing drafts, move the lengths back. `graphed`: the forward as capturable kernels, else
        `forward` (eager, host bounds)."""
        T, k, eng = self.T, self.k, be.engine
        drafts, source = self.draft(w)
        act = be.active[:w].clone()
        ids, num_new = torch.cat([be.cur[:w, None], drafts], dim=1), act.long() * T
        out = eng.capturable_forward(ids, num_new) if graphed else eng.forward(ids, num_new)
        logits = out.logits                                      # [w, T, V]
        n_gen = be.n_gen[:w]
        steps = n_gen[:, None] + self.ar_T                       # each position's token index in its answer
        tok = next_tokens(logits.reshape(w * T, -1), be.keys[:w].repeat_interleave(T), steps.reshape(-1),
                          dec).view(w, T)
        agree = (drafts == tok[:, :k]).long().cumprod(dim=1).sum(dim=1)
        is_eos = (tok[..., None] == be.eos).any(dim=-1)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1), T)
        n = torch.minimum(torch.minimum(agree, first_eos) + 1, be.max_new - n_gen)
        n = torch.where(act, n, 0)
        keep = self.ar_T[None] < n[:, None]                      # [w, T]: the positions this step keeps
        be.out[:w].scatter_(1, torch.where(keep, steps, be.max_new), tok)
        self.hist[:w].scatter_(1, torch.where(keep, self.hlen[:w, None] + self.ar_T, self.spare), tok)
        if self.table is not None:
            self.table.record(self.hist[:w], self.hlen[:w], n)
            self.shared_rows += ((source == 2) & act).sum()
        self.hlen[:w] += n
        eng.lengths[:w] -= torch.where(act, T - n, 0)           # the rejected drafts' K / V are past the length
        last = tok.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        be.cur[:w].copy_(torch.where(act, last, be.cur[:w]))
        hit = act & (first_eos < n)
        be.ended[:w] |= hit
        n_gen += n
        be.active[:w].copy_(act & ~hit & (n_gen < be.max_new))
        be.live_row_steps += act.sum()
        self.kept += n.sum()
        self.drafted_rows += ((source > 0) & act).sum()

    def stats(self, live_row_steps: int) -> dict:
        """Tokens kept per live row and step (1.0 = no draft ever kept), and the share of live row-steps whose
        history held a match (one host sync)."""
        live = max(1, live_row_steps)
        return {"lookup_draft": self.k, "lookup_graphs": len(self._graphs),
                "kept_per_row_step": round(int(self.kept) / live, 3),
                "lookup_found_share": round(int(self.drafted_rows) / live, 3),
                "lookup_shared_share": None if self.table is None else round(int(self.shared_rows) / live, 3)}
