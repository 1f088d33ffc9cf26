"""Acceptance by replay: a method's steps walked against the target-only reference, without verify forwards.

Greedy speculative decoding commits only target argmaxes, so its output is the target-only greedy
output (the reference) and every verify's answer is already known: at step i, with `out` the tokens
committed so far, the target's argmax at block slot k is ref[len(out) + k]. What a method proposes
depends only on the committed tokens (prompt lookup) or on them and the target's features of the
committed prefix (DFlash). So one target pass over prompt + reference fills the feature buffer, and
the method's drafts are then proposed step by step and accepted against the reference on the host:

    out = [ref[0]]
    while out[-1] is not EOS and len(out) < max_new:
        limit  = min(B - 1, max_new - len(out) - 1)       # as speculative_generate
        drafts = proposer.propose(prompt + out, features, limit)
        accepted = longest prefix of drafts equal to ref[len(out):]
        commit drafts[:accepted] + [ref[len(out) + accepted]], cut at EOS

The steps, accepted and committed counts, and so tau and the per-position acceptance, equal real
decoding's in exact arithmetic. In floating point two things can differ: the features (one pass
over the whole sequence instead of the prompt's prefill plus verify chunks: rounding only), and the
step after an accepted EOS draft (decoding also compares drafts with the target's argmaxes past the
EOS; replay stops at the EOS; tau, which counts committed tokens, is the same). The eval decodes
the --baseline-every sample for real and checks replay against it there (`replay_checked`,
`replay_agreed` in the report).

A DFlash step costs one drafter forward (the context cache grows by the committed rows, as in
decoding); a prompt-lookup step costs host work only. No verify forward, no KV cache crop.

Teacher-forced scan (`scan_every` > 0, `eval --teacher-forced-every N`): with the same features, a block is
also anchored at every N-th token of the reference, wherever decoding would or would not step, and its tau
(1 + the drafts matching the reference) is summed. This is the training loss's simulated tau (drafter/loss.py)
on the eval's own text: its mean over the blocks is what training reports as tau, its harmonic mean what it
reports as the walk estimate. Beside the decoded tau it splits a gap between training's numbers and decoding
into "the text differs" (teacher-forced tau here far from the validation cache's) and "decoding steps where
tau is low" (teacher-forced tau as on the validation cache, decoded tau near the harmonic mean).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .specdecode import SpecResult, sync_fn


def replay_generate(verifier, proposer, prompt_ids: Sequence[int], ref: Sequence[int], *, block_size: int,
                    max_new_tokens: int, eos_ids: Sequence[int], scan_every: int = 0) -> SpecResult:
    """`speculative_generate`'s step record for `proposer`, its verify answers read from `ref` (the target-only
    greedy output of `prompt_ids`, EOS kept). `verifier` fills the feature buffer when the proposer needs one.
    scan_every > 0 also runs the teacher-forced scan (module docstring) into the result's scan_* fields."""
    eos = set(int(e) for e in eos_ids)
    ref, prompt = [int(t) for t in ref], [int(t) for t in prompt_ids]
    t0 = time.perf_counter()
    feats = None
    if hasattr(proposer, "reset"):
        proposer.reset()
    if proposer.needs_features and len(ref) > 1:
        # rows 0 .. len(prompt) + len(ref) - 2: every context row a block anchored at a committed token can see
        verifier.prefill(prompt + ref[:-1], feature_rows=len(prompt) + max_new_tokens + block_size)
        feats = verifier.features()
    out = ref[:1]
    res = SpecResult(out, block_size, replayed=True)
    res.prefill_s = time.perf_counter() - t0
    while out and out[-1] not in eos and len(out) < max_new_tokens:
        n = len(out)
        limit = min(block_size - 1, max_new_tokens - n - 1)
        t_draft = time.perf_counter()
        drafts = list(proposer.propose(prompt + out, feats, limit))[:limit] if limit else []
        res.draft_s += time.perf_counter() - t_draft
        accepted = _matching(drafts, ref, n)
        new = drafts[:accepted] + ref[n + accepted:n + accepted + 1]    # no bonus token past the reference's end
        res.record_step(drafts, accepted, new, limit, eos)
    sync_fn(verifier.device)()
    res.wall_s = time.perf_counter() - t0
    if scan_every:
        teacher_forced_scan(proposer, prompt, ref, feats, block_size, scan_every, res)
        sync_fn(verifier.device)()
        res.scan_s = time.perf_counter() - t0 - res.wall_s
    return res


def teacher_forced_scan(proposer, prompt: list[int], ref: list[int], feats, block_size: int, every: int,
                        res: SpecResult) -> None:
    """Blocks anchored at reference tokens 0, every, 2 * every, ...: the block at token n - 1 drafts
    ref[n : n + B - 1] (fewer at the end) from prompt + ref[:n] and the features; its tau is 1 + the drafts
    that match the reference before the first miss. Appends those matched drafts to res.scan_matched (every method
    scans the same anchors, so the lists of two methods pair block by block; the sums are SpecResult properties).
    Anchors advance by at most the block size, as a decoding step does (the buffered proposer's update needs it)."""
    if not 0 < every <= block_size:
        raise ValueError(f"scan_every must be in 1..{block_size}, got {every}")
    if hasattr(proposer, "reset"):
        proposer.reset()
    for n in range(1, len(ref), every):
        limit = min(block_size - 1, len(ref) - n)
        res.scan_matched.append(_matching(list(proposer.propose(prompt + ref[:n], feats, limit))[:limit], ref, n))


def _matching(drafts: list[int], ref: list[int], n: int) -> int:
    """How many leading drafts equal the reference from token n on (what a verify would accept)."""
    k = 0
    while k < len(drafts) and n + k < len(ref) and drafts[k] == ref[n + k]:
        k += 1
    return k


def replay_methods(methods, ids, ref, block_size, max_new_tokens, eos, scan_every: int = 0) -> dict[str, SpecResult]:
    """{method: its replayed generation of `ids` against `ref`} for (name, verifier, proposer) triples, in order."""
    return {name: replay_generate(verifier, proposer, ids, ref, block_size=block_size,
                                  max_new_tokens=max_new_tokens, eos_ids=eos, scan_every=scan_every)
            for name, verifier, proposer in methods}


SCAN_FIELDS = ("scan_matched", "scan_s")


def copy_scan(dst: SpecResult, src: SpecResult) -> None:
    """A decoded generation takes the teacher-forced scan of its check replay (the scan needs the replay's features)."""
    for f in SCAN_FIELDS:
        setattr(dst, f, getattr(src, f))


def same_steps(a: SpecResult, b: SpecResult) -> bool:
    """Whether two records of one generation took the same steps (accepted and committed per step)."""
    return a.accepted == b.accepted and a.committed == b.committed
