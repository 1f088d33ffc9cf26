"""Aggregate generations into the eval report: JSON, a Markdown table and the acceptance plot.

Per prompt set and method:
  * tau = tokens committed by verify steps / verify steps, over the whole set (the token-weighted
    acceptance length serving benchmarks report; the prefill's first token is not a step);
  * per-position acceptance: for slot k = 1..B-1, the fraction of steps (where the token budget
    allowed a draft in slot k) whose drafts were accepted up to slot k;
  * tokens/s = generated tokens / wall time over the set; speedup = method tokens/s divided by
    target-only greedy tokens/s on the same prompts, both at batch 1 (omitted when the target ran
    in 'recompute' cache mode, whose timings say nothing about a serving engine; with batched
    references, on the generations timed at batch 1: reference_batch.batched_summary);
  * time split of a method's wall time: target (prefill + verify forwards, with the rollback
    re-feeds of a hybrid target), draft (the proposer) and other (accept logic, bookkeeping,
    Python between the two), in seconds in the JSON and as shares in the table;
  * identical: fraction of prompts whose output equals target-only greedy decoding;
  * tau / n-gram: a drafter's tau over the prompt-lookup baseline's on the same prompts.
Methods: "dflash" (one drafter) or "dflash:<name>" (several, see runner.py) and "ngram".
"""

from __future__ import annotations

import math
from pathlib import Path

from ..io_utils import read_jsonl, write_optional
from .specdecode import SpecResult

BASELINE = "ngram"


def method_label(method: str) -> str:
    """'dflash' -> DFlash, 'dflash:fp8' -> DFlash[fp8], 'ngram' -> n-gram."""
    if method.startswith("dflash:"):
        return f"DFlash[{method[len('dflash:'):]}]"
    return {"dflash": "DFlash", "ngram": "n-gram"}.get(method, method)


def methods_of(set_summary: dict) -> list[str]:
    """The speculative methods of one set's summary, drafters first (report order), the baseline last."""
    drafters = [k for k in set_summary if k == "dflash" or k.startswith("dflash:")]
    return drafters + ([BASELINE] if BASELINE in set_summary else [])


def method_summary(results: list[SpecResult], reference: list[list[int]], target_tok_s: float | None,
                   with_speedup: bool) -> dict:
    block = results[0].block_size if results else 0
    steps = sum(r.steps for r in results)
    committed = sum(sum(r.committed) for r in results)
    acc, elig = [0] * max(0, block - 1), [0] * max(0, block - 1)
    for r in results:
        a, e = r.slot_counts()
        acc = [x + y for x, y in zip(acc, a)]
        elig = [x + y for x, y in zip(elig, e)]
    # time and identity from the decoded generations only: a replayed one (replay.py) reproduces the reference by
    # construction and spends no verify forwards; tau and acceptance above count every generation
    decoded = [(r, ref) for r, ref in zip(results, reference) if not r.replayed]
    tokens = sum(len(r.tokens) for r in results)
    wall = sum(r.wall_s for r, _ in decoded)
    draft, verify, prefill = (sum(getattr(r, k) for r, _ in decoded) for k in ("draft_s", "verify_s", "prefill_s"))
    tok_s = sum(len(r.tokens) for r, _ in decoded) / wall if wall > 0 else None
    speedup = tok_s / target_tok_s if with_speedup and tok_s and target_tok_s else None
    identical = sum(r.tokens == ref for r, ref in decoded)
    return {
        "tau": committed / steps if steps else None,
        "acceptance": [a / e if e else None for a, e in zip(acc, elig)],
        "accepted_per_slot": acc, "eligible_per_slot": elig,
        "steps": steps, "target_forwards": sum(r.target_forwards for r in results),
        "refeeds": sum(r.refeeds for r in results),
        "generated_tokens": tokens, "wall_s": wall, "draft_s": draft, "verify_s": verify, "prefill_s": prefill,
        "other_s": max(0.0, wall - draft - verify - prefill),
        "tokens_per_s": tok_s, "speedup": speedup,
        "replay_s": sum(r.wall_s for r in results if r.replayed),   # --replay: the replayed generations' time
        "identical_to_target": identical / len(decoded) if decoded else None,
        **_teacher_forced(results),
    }


def _teacher_forced(results: list[SpecResult]) -> dict:
    """{"teacher_forced": mean tau, harmonic mean ("tau_walk"), blocks} of the scans (--teacher-forced-every)."""
    blocks = sum(r.scan_blocks for r in results)
    if not blocks:
        return {}
    inv = sum(r.scan_inv_tau_sum for r in results)
    return {"teacher_forced": {"blocks": blocks, "tau": sum(r.scan_tau_sum for r in results) / blocks,
                               "tau_walk": blocks / inv, "scan_s": sum(r.scan_s for r in results)}}


def _finite(recs: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in recs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _tail_mean(xs: list[float]) -> float:
    """Mean over the last 10 % of the records (at least one)."""
    tail = xs[-max(1, len(xs) // 10):]
    return sum(tail) / len(tail)


def training_tau(train_dir: Path) -> dict | None:
    """Simulated tau logged by training: the last record and the mean over the last 10 % of records;
    the decoding-walk estimate (drafter/loss.py) and the last held-out validation pass when logged."""
    path = Path(train_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    recs = read_jsonl(path)
    taus = _finite(recs, "tau")
    if not taus:
        return None
    out = {"metrics_file": str(path), "records": len(taus), "tau_last": taus[-1],
           "tau_last_10pct_mean": _tail_mean(taus), "steps": max(int(r["step"]) for r in recs if "step" in r) + 1}
    walks = _finite(recs, "tau_walk")
    if walks:
        out["tau_walk_last_10pct_mean"] = _tail_mean(walks)
    val_path = Path(train_dir) / "val_metrics.jsonl"
    vals = [r for r in read_jsonl(val_path) if _finite([r], "val_tau")] if val_path.is_file() else []
    if vals:  # held-out cache (--val-cache-dir), last pass
        last = vals[-1]
        out.update(val_step=last["step"] + 1, val_tau=last["val_tau"], val_tau_walk=last.get("val_tau_walk"))
    return out


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def time_split(r: dict) -> str:
    """'target / draft / other' shares of a method's wall time, e.g. '71 / 22 / 7 %'."""
    wall = r.get("wall_s") or 0.0
    if wall <= 0 or "verify_s" not in r:
        return "-"
    parts = (r["verify_s"] + r.get("prefill_s", 0.0), r.get("draft_s", 0.0), r.get("other_s", 0.0))
    return " / ".join(f"{100 * x / wall:.0f}" for x in parts) + " %"


def _prompts_cell(s: dict) -> str:
    gens = s.get("generations", s["prompts"])
    return str(s["prompts"]) if gens == s["prompts"] else f"{s['prompts']} ({gens} turns)"


def markdown_table(report: dict) -> str:
    lines = ["| set | prompts | method | tau | tau / n-gram | tok/s | speedup (batch 1) | time target / draft / other "
             "| identical to target-only |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    skipped = []
    for name, s in report["sets"].items():
        n = _prompts_cell(s)
        lines.append(f"| {name} | {n} | target-only | - | - | "
                     f"{_fmt(s['target_only']['tokens_per_s'], ',.1f')} | - | 100 / 0 / 0 % | - |")
        base = s.get(BASELINE, {}).get("tau")
        for m in methods_of(s):
            r = s[m]
            ratio = r["tau"] / base if r["tau"] is not None and base else None
            lines.append(f"| {name} | {n} | {method_label(m)} | {_fmt(r['tau'])} | "
                         f"{_fmt(ratio, '.2f', 'x') if m != BASELINE else '-'} | {_fmt(r['tokens_per_s'], ',.1f')} | "
                         f"{_fmt(r['speedup'], '.2f', 'x')} | {time_split(r)} | "
                         f"{_fmt(r['identical_to_target'], '.0%')} |")
        if s.get("skipped_ids"):
            skipped.append(f"{name}: " + ", ".join(f"{x['id']} ({x['prompt_tokens']} tokens)" for x in s["skipped_ids"]))
    if skipped:
        lines += ["", f"Skipped (prompt empty or longer than {report.get('max_prompt_tokens', '?')} tokens, the "
                      f"context left after the new tokens and one block): " + "; ".join(skipped) + "."]
    for m, tr in (report.get("training") or {}).items():
        if not tr:
            continue
        lines.append("")
        walk = (f" (decoding-walk estimate {tr['tau_walk_last_10pct_mean']:.2f})"
                if tr.get("tau_walk_last_10pct_mean") is not None else "")
        lines.append(f"{method_label(m)}: training-time simulated tau: last {tr['tau_last']:.2f}, mean of the last "
                     f"10 % of logged steps {tr['tau_last_10pct_mean']:.2f}{walk} (eval tau above is real speculative "
                     f"decoding).")
        if tr.get("val_tau") is not None:
            vw = f" (walk estimate {tr['val_tau_walk']:.2f})" if tr.get("val_tau_walk") is not None else ""
            lines.append(f"Held-out validation cache after step {tr['val_step']}: simulated tau "
                         f"{tr['val_tau']:.2f}{vw}.")
    note = identity_note(report)
    if note:
        lines += ["", note]
    if report.get("cache_mode") == "recompute":
        lines.append("")
        lines.append("Target ran in 'recompute' cache mode (recurrent layers): tau is exact, speedups are omitted.")
    return "\n".join(lines) + "\n"


EXACT_DTYPES = ("float32", "float64")


def identity_note(report: dict) -> str | None:
    """Why some outputs differ from target-only greedy decoding, or None when they all match.

    Committing only target argmaxes makes the output identical to target-only decoding in exact
    arithmetic. In bf16/fp16 the (k+1)-token verify forward and the 1-token forward round differently
    and flip near-tied argmaxes (SmolLM2 on the H200: 0 of 6 MT-Bench prompts identical in bf16, every
    prompt in fp32; BENCHMARKS.md, session 6), so the texts, and the tau measured on them, drift apart.
    In fp32 a mismatch is not expected: it points at the verifier or the cache.
    """
    worst = [(name, m, s[m]["identical_to_target"]) for name, s in report["sets"].items() for m in methods_of(s)
             if s[m].get("identical_to_target") is not None and s[m]["identical_to_target"] < 1]
    if not worst:
        return None
    dtype = str((report.get("target") or {}).get("dtype") or "unknown")
    where = ", ".join(f"{method_label(m)} on {name} {frac:.0%}" for name, m, frac in worst)
    if dtype not in EXACT_DTYPES:
        return (f"Not every output is identical to target-only ({where}): the target ran in {dtype}, where a "
                f"multi-token verify forward and a one-token forward round differently and flip near-tied "
                f"argmaxes. Rerun with --target-dtype float32 for exact identity.")
    return (f"Not every output is identical to target-only ({where}) although the target ran in {dtype}: "
            f"this is not expected from rounding. Check the target's cache mode and report it as a bug with "
            f"eval_prompts.jsonl.")


def acceptance_markdown(report: dict) -> str:
    out = []
    for name, s in report["sets"].items():
        ms = methods_of(s)
        k = len(s[ms[0]]["acceptance"]) if ms else 0
        out.append(f"\nPer-position acceptance, {name}:\n")
        out.append("| method | " + " | ".join(str(i) for i in range(1, k + 1)) + " |")
        out.append("|---|" + "---:|" * k)
        for m in ms:
            out.append(f"| {method_label(m)} | " + " | ".join(_fmt(a) for a in s[m]["acceptance"]) + " |")
        tf = [m for m in ms if s[m].get("teacher_forced")]
        if tf:
            out.append(f"\nTeacher-forced on the references, {name} (a block anchored along each reference; "
                       "training's simulated tau on this text):\n")
            out.append("| method | decoded tau | teacher-forced tau | harmonic mean (walk) | blocks |")
            out.append("|---|---:|---:|---:|---:|")
            for m in tf:
                t = s[m]["teacher_forced"]
                out.append(f"| {method_label(m)} | {_fmt(s[m]['tau'])} | {_fmt(t['tau'])} | {_fmt(t['tau_walk'])} | "
                           f"{t['blocks']} |")
    return "\n".join(out) + "\n"


def plot_acceptance(report: dict, out_png: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    markers = "osD^v<>p*h"
    for i, (name, s) in enumerate(report["sets"].items()):
        color = f"C{i % 10}"
        for j, m in enumerate(methods_of(s)):
            style = "--x" if m == BASELINE else f"-{markers[j % len(markers)]}"
            acc = s[m]["acceptance"]
            ks = [k + 1 for k, a in enumerate(acc) if a is not None]
            ax.plot(ks, [a for a in acc if a is not None], style, color=color,
                    label=f"{name} {method_label(m)} (tau {_fmt(s[m]['tau'])})", ms=3)
    ax.set_xlabel("block position k")
    ax.set_ylabel("fraction of steps accepted through k")
    ax.set_ylim(0, 1.02)
    ax.set_title("per-position acceptance: DFlash vs n-gram")
    ax.legend(fontsize=8)
    fig.tight_layout()
    ok = write_optional(out_png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "acceptance plot")
    plt.close(fig)
    return out_png if ok else None
