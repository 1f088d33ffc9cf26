"""Greedy speculative decoding (batch 1) with a DFlash drafter, as serving engines run it.

One generation:

  1. the target prefills the prompt (capturing its features at the drafter's layers, see
     `target_step`) and produces the first token;
  2. each step, with p = position of the last committed token:
       * the proposer drafts up to B-1 tokens. For DFlash the block input is
         [token p, MASK x (B-1)] at positions p..p+B-1 and the context is the target
         features of tokens 0..p-1: exactly the training layout (SPEC §5) with the anchor at
         context index p, which the block may not see (kv < anchor, strictly). The anchor's
         own context row is present but masked, so the mask is the training `AttentionMask`
         unchanged. Slot k's draft is argmax(lm_head(drafter output k)), k = 1..B-1;
       * the target verifies [token p, drafts] in ONE forward with its KV cache;
       * drafts are accepted while they equal the target's argmax, then the target's own next
         token is appended, so each step commits tau = accepted + 1 tokens;
       * the cache is cropped back to the committed length.
  3. stop at an EOS token (kept in the output, as HF generate does) or max_new_tokens.

Because every committed token is a target argmax given the committed prefix, the output is
identical to target-only greedy decoding whatever the proposer does (up to floating-point
differences between a (k+1)-token and a 1-token forward, which in fp32 do not flip an argmax
in practice; in bf16 they occasionally do, and the report counts identical outputs).

Proposers share one interface, so DFlash, the n-gram baseline and test oracles run through the
same verify/accept code: ``propose(tokens, features, num) -> list[int]`` where `tokens` are the
committed tokens (last = token p), `features` the target feature buffer (rows 0..p-1 valid;
None unless ``needs_features``) and `num` the most drafts this step may use (<= B-1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..drafter import AttentionMask, DFlashDrafter, DrafterModelConfig, block_positions
from ..errors import UsageError
from .target_step import FeatureCapture, TargetVerifier


class Proposer(Protocol):
    needs_features: bool

    def propose(self, tokens: list[int], features: torch.Tensor | None, num: int) -> list[int]: ...


@dataclass
class SpecResult:
    """One generation. Per step i: drafts proposed, drafts accepted, slots the budget allowed."""

    tokens: list[int]                              # generated tokens (EOS included if hit)
    block_size: int
    target_forwards: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    slot_limit: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)   # tokens committed per step (after EOS cut)
    wall_s: float = 0.0
    draft_s: float = 0.0                                 # proposer time (drafter forward + argmax)
    verify_s: float = 0.0                                # target verify + commit (crop / rollback re-feed)
    prefill_s: float = 0.0                               # the prompt's forward (first token)
    refeeds: int = 0                                     # rollback re-feed forwards (recurrent targets)
    replayed: bool = False                               # steps walked against the reference (replay.py), not decoded
    replay_agrees: bool | None = None                    # decoded and also replayed: the same steps? (None: not checked)
    # --teacher-forced-every (replay.teacher_forced_scan): the drafts matched per block anchored along the
    # reference (in anchor order; a block's tau is 1 + its matched drafts), and the scan's time
    scan_matched: list[int] = field(default_factory=list)
    scan_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def scan_blocks(self) -> int:
        return len(self.scan_matched)

    @property
    def scan_tau_sum(self) -> int:
        return sum(1 + m for m in self.scan_matched)

    @property
    def scan_inv_tau_sum(self) -> float:
        return sum(1 / (1 + m) for m in self.scan_matched)

    def record_step(self, drafts: list[int], accepted: int, new: list[int], limit: int, eos: set[int]) -> None:
        """Commit `new` (the accepted drafts + the target's own token) up to and including an EOS; log the step."""
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        self.tokens.extend(new[:cut])
        self.proposed.append(len(drafts))
        self.accepted.append(accepted)
        self.slot_limit.append(limit)
        self.committed.append(cut)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per verify step (accepted drafts + the target's own token)."""
        return sum(self.committed) / self.steps if self.steps else None

    def slot_counts(self) -> tuple[list[int], list[int]]:
        """(accepted, eligible) per slot k = 1..B-1: steps where slot k was accepted / could be.

        A slot is eligible when the token budget allowed a draft there; a proposer that drafts
        fewer tokens (n-gram with no match) still counts as eligible and not accepted.
        """
        n = self.block_size - 1
        acc, elig = [0] * n, [0] * n
        for a, limit in zip(self.accepted, self.slot_limit):
            for k in range(limit):
                elig[k] += 1
                acc[k] += k < a
        return acc, elig


def speculative_generate(verifier: TargetVerifier, proposer: Proposer, prompt_ids: Sequence[int], *,
                         block_size: int, max_new_tokens: int, eos_ids: Sequence[int]) -> SpecResult:
    """Generate with `proposer` drafting and the verifier's target deciding (module docstring)."""
    if block_size < 2:
        raise UsageError(f"block_size must be >= 2, got {block_size}")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if proposer.needs_features and not verifier.has_features:
        raise UsageError("this proposer needs target features: build the TargetVerifier with a FeatureCapture")
    eos = set(int(e) for e in eos_ids)
    # No device sync per phase: each phase ends on a host read of its result (the drafts as a list of ints,
    # the verify's argmax), which waits for that phase's GPU work, so the host clock splits the time; the only
    # work left in flight at a phase end is the commit's cache crop (a few tiny kernels, counted in the next
    # phase). One sync at the end closes the generation's wall time.
    sync = sync_fn(verifier.device)
    t0 = time.perf_counter()
    if hasattr(proposer, "reset"):
        proposer.reset()                                 # per-generation state (DFlash's context cache)
    first = verifier.prefill(prompt_ids, feature_rows=len(prompt_ids) + max_new_tokens + block_size)
    out = [first]
    res = SpecResult(out, block_size)
    res.prefill_s = time.perf_counter() - t0
    while out[-1] not in eos and len(out) < max_new_tokens:
        remaining = max_new_tokens - len(out)
        limit = min(block_size - 1, remaining - 1)      # the target adds one token of its own
        feats = verifier.features() if proposer.needs_features else None
        t_draft = time.perf_counter()
        drafts = list(proposer.propose(list(verifier.tokens), feats, limit))[:limit] if limit else []
        res.draft_s += time.perf_counter() - t_draft
        t_verify = time.perf_counter()
        target = verifier.verify(drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        new = drafts[:accepted] + [target[accepted]]
        verifier.commit(accepted, target[accepted])
        res.verify_s += time.perf_counter() - t_verify
        res.record_step(drafts, accepted, new, limit, eos)
    sync()
    res.wall_s = time.perf_counter() - t0
    res.target_forwards = verifier.forwards
    res.refeeds = verifier.refeeds
    return res


def sync_fn(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class DFlashProposer:
    """Drafts one block with a DFlash drafter over the target's features (module docstring).

    context_cache (default): each committed token's context keys/values are computed once and kept
    (as vLLM's DFlash path does), so a step costs fc + k/v projections for the newly committed
    tokens only, instead of for the whole context. Rows of the feature buffer below the anchor are
    final once committed (the verifier writes a row when its token is first fed), so the cache never
    goes stale within a generation; `reset()` (called by speculative_generate) starts a new one. (In
    the 'recompute' cache mode every verify re-runs the whole sequence and rewrites the committed rows
    with the same values up to rounding; the cache keeps the first ones. The 'rollback' mode's re-feed
    writes no rows.)
    context_cache=False recomputes the context every step through the training forward (reference).
    """

    needs_features = True

    def __init__(self, drafter: DFlashDrafter, cfg: DrafterModelConfig, embed_VH: torch.Tensor,
                 lm_head: torch.nn.Module, *, context_cache: bool = True):
        self.drafter = drafter.eval()
        self.cfg = cfg
        self.embed_VH = embed_VH
        self.lm_head = lm_head
        self.device = embed_VH.device
        self.context_cache = context_cache
        self.reset()

    def reset(self) -> None:
        """Forget the cached context keys/values (a new generation starts)."""
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._rows = 0

    @staticmethod
    def _anchor(tokens: list[int]) -> int:
        """p, the index of the last committed token, which the block is anchored at."""
        if len(tokens) < 2:
            raise UsageError("DFlash needs at least one context token before the block")
        return len(tokens) - 1

    def block_inputs(self, tokens: list[int], features: torch.Tensor):
        """(context features [p+1, F], block embeds [B, H], ctx positions, block positions, mask)."""
        p, B = self._anchor(tokens), self.cfg.block_size
        ctx = features[:p + 1]   # row p (the anchor's slot) is masked: a block sees kv < anchor
        ctx_pos = torch.arange(p + 1, device=self.device)
        anchor = torch.tensor([p], dtype=torch.long, device=self.device)
        return ctx, self._block_embeds(tokens), ctx_pos, block_positions(ctx_pos, anchor, B), self._mask(p + 1, p)

    def _block_embeds(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.full((self.cfg.block_size,), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        ids[0] = tokens[-1]
        return self.embed_VH[ids]

    def _mask(self, ctx_len: int, anchor: int) -> AttentionMask:
        d = self.device
        return AttentionMask(torch.zeros(ctx_len, dtype=torch.int32, device=d),
                             torch.tensor([anchor], dtype=torch.long, device=d),
                             torch.zeros(1, dtype=torch.int32, device=d), torch.ones(1, dtype=torch.bool, device=d),
                             self.cfg.block_size)

    def _context_kv(self, features: torch.Tensor, p: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of context rows 0..p, extending the cache by the rows committed since. Row p is
        the anchor's own slot, masked as in training (AttentionMask wants the anchor inside the context);
        it is still zeros, never uninitialised memory, whose NaNs would survive the mask."""
        if self._kv is not None and (p < self._rows or self._kv[0][0].shape[0] <= p):
            self.reset()                        # not the generation the cache was built for
        if self._rows < p:
            pos = torch.arange(self._rows, p, device=self.device)
            new = self.drafter.context_kv(features[self._rows:p], pos)
            if self._kv is None:                # one buffer per layer, as many rows as the feature buffer
                rows = features.shape[0]
                self._kv = [(k.new_zeros((rows, *k.shape[1:])), v.new_zeros((rows, *v.shape[1:]))) for k, v in new]
            for (kb, vb), (k, v) in zip(self._kv, new):
                kb[self._rows:p], vb[self._rows:p] = k, v
            self._rows = p
        return [(kb[:p + 1], vb[:p + 1]) for kb, vb in self._kv]

    @torch.inference_mode()
    def block_hidden(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The drafter's final hidden states [B, H] for the block anchored at the last committed token."""
        if not self.context_cache:
            return self.drafter(*self.block_inputs(tokens, features))
        p = self._anchor(tokens)
        blk_pos = torch.arange(p, p + self.cfg.block_size, device=self.device)
        return self.drafter.forward_cached(self._context_kv(features, p), self._block_embeds(tokens), blk_pos,
                                           self._mask(p + 1, p))

    @torch.inference_mode()
    def propose(self, tokens: list[int], features: torch.Tensor | None, num: int) -> list[int]:
        if num <= 0:
            return []
        draft_hidden = self.block_hidden(tokens, features)[1:1 + num].to(self.lm_head.weight.dtype)
        return [int(t) for t in self.lm_head(draft_hidden).argmax(dim=-1).tolist()]


def make_dflash_verifier(model: torch.nn.Module, cfg: DrafterModelConfig, num_layers: int, hidden_size: int,
                         cache_mode: str = "auto", refeed: str = "forward") -> TargetVerifier:
    """A verifier whose hooks capture the drafter's `target_layer_ids` (call .capture.close() after)."""
    capture = FeatureCapture(model, cfg.target_layer_ids, num_layers, hidden_size)
    return TargetVerifier(model, cache_mode=cache_mode, capture=capture, refeed=refeed)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """EOS ids from the generation config and the tokenizer (SmolLM2: <|im_end|> = 2)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)
