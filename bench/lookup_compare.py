"""DFlash against prompt lookup where lookup can copy: the per-prompt split by lookup's own tau, and the
teacher-forced blocks paired anchor by anchor (eval --teacher-forced-every). Used by bench/quality_summary.py
(the quality report's tables) and bench/eval_compare.py; inputs are eval_prompts.jsonl rows or their counts."""

from __future__ import annotations

LOOKUP_SPLIT = 1.6   # prompts where prompt lookup's own tau is below this have little repeated text to copy


def pooled_tau(counts: dict[str, tuple[int, int]], ids) -> float | None:
    """Pooled tau (committed tokens / verify steps) of `counts` over the prompt ids `ids`; None for no prompt."""
    ids = list(ids)
    return sum(counts[i][0] for i in ids) / sum(counts[i][1] for i in ids) if ids else None


def _pooled_sides(mine: dict, look: dict, sides) -> dict:
    """{side: the prompts (both methods decoded) that `keep(id)` selects, and both methods' pooled tau there}."""
    out = {}
    for side, keep in sides:
        part = [i for i in mine if i in look and keep(i)]
        out[side] = {"prompts": len(part), "method_tau": pooled_tau(mine, part), "lookup_tau": pooled_tau(look, part)}
    return out


def lookup_split(counts: dict[str, dict[str, tuple[int, int]]], method: str, at: float = LOOKUP_SPLIT) -> dict | None:
    """The method's and prompt lookup's pooled tau on the prompts where lookup's own tau is below `at`, and on
    the rest: where the output repeats, lookup copies whole blocks (issue 19, session 15)."""
    look, mine = counts.get("ngram"), counts.get(method)
    if not look or not mine:
        return None
    below = lambda i: look[i][0] / look[i][1] < at  # noqa: E731
    return {"at": at, **_pooled_sides(mine, look, (("below", below), ("at_or_above", lambda i: not below(i))))}


def turn_split(counts: dict[str, dict[str, tuple[int, int]]], method: str) -> dict | None:
    """The method's and prompt lookup's pooled tau per MT-Bench turn (ids ending in /turn2 are second turns; None
    when the set has none). A second turn repeats much of the first answer, which lookup copies (session 19:
    DFlash / lookup 1.21x on first turns, 0.98x on second turns)."""
    look, mine = counts.get("ngram"), counts.get(method)
    if not look or not mine or not any(i.endswith("/turn2") for i in mine):
        return None
    second = lambda i: i.endswith("/turn2")  # noqa: E731
    return _pooled_sides(mine, look, (("1", lambda i: not second(i)), ("2", second)))


COPY_BINS = ((0, 0), (1, 7), (8, 14), (15, 15))   # drafts lookup matched in a teacher-forced block (of 15)


def teacher_forced_scans(rows, set_name: str) -> dict[str, dict[str, list[int]]]:
    """method -> {generation id: matched drafts per teacher-forced block} (eval --teacher-forced-every)."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in rows:
        if r.get("scan_matched") is not None and r["set"] == set_name:
            out.setdefault(r["method"], {})[r["id"]] = r["scan_matched"]
    return out


def copy_bins(scans: dict[str, dict[str, list[int]]], method: str) -> list[dict] | None:
    """The method's teacher-forced blocks grouped by how many drafts prompt lookup matched at the same anchor
    (0, 1-7, 8-14, all 15): per group the blocks, both methods' mean tau and the share of the method's blocks
    that were whole. Where lookup copies a whole block, does the drafter too?"""
    look, mine = scans.get("ngram"), scans.get(method)
    if not look or not mine:
        return None
    pairs = [(a, b) for g in mine if g in look and len(look[g]) == len(mine[g]) for a, b in zip(look[g], mine[g])]
    out = []
    for lo, hi in COPY_BINS:
        sel = [(a, b) for a, b in pairs if lo <= a <= hi]
        n = len(sel)
        out.append({"lookup_matched": [lo, hi], "blocks": n,
                    "lookup_tau": 1 + sum(a for a, _ in sel) / n if n else None,
                    "method_tau": 1 + sum(b for _, b in sel) / n if n else None,
                    "method_whole": sum(b >= 15 for _, b in sel) / n if n else None})
    return out
