"""Issue-5 quality report from the outputs of bench/quality_gpu.sh (works on partial results too).

    python bench/quality_report.py --dir /tmp/quality --out $OUT

Reads <dir>/regenerated.jsonl.progress.json, cache-{lossless,fp8,val}/manifest.json, the training runs
(train-lossless, train-fp8, train-seed<N>, scale-<subset>, var-<name>: metrics.jsonl, val_metrics.jsonl,
resolved_config.toml), eval-<set>/eval_report.json + eval_prompts.jsonl (one eval per set, every drafter
in it as method dflash:<run name>) and done/*.seconds, and writes to --out:
  summary.json     every number below, machine-readable
  summary.md       DFlash tau vs prompt-lookup tau per set (ratio; goal >= 2x); every drafter against the
                   lossless one on the same prompts, with a paired bootstrap 95 % interval over prompts (fp8:
                   goal within 1 %; seed<N>: the training-noise floor); simulated tau against training tokens
                   and against unique data; data/cache/stage-time facts
  quality.png      per-position acceptance per set + simulated tau vs tokens
  results.tar.gz   eval reports/prompts/PNGs, metrics.jsonl, training.png, configs, manifests, logs (tails)
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

from quality_summary import CODECS, REFERENCE, SETS, WINDOWS, _f, _tokens, build, runs, training_curve, validation_curve

LOG_TAIL_BYTES = 1 << 20


def _teacher_forced_table(summary: dict) -> list[str]:
    """eval --teacher-forced-every: each method's simulated tau on the eval's own references, beside its decoded tau."""
    rows = []
    for s, row in summary["sets"].items():
        for name, r in row.get("drafters", {}).items():
            tf = r.get("teacher_forced")
            if tf:
                rows.append(f"| {name} | {s} | {_f(r['tau'])} | {_f(tf['tau'])} | {_f(tf['tau_walk'])} |")
        tf = row.get("ngram_teacher_forced")
        if tf:
            rows.append(f"| prompt lookup | {s} | {_f(row['ngram_tau'])} | {_f(tf['tau'])} | {_f(tf['tau_walk'])} |")
    if not rows:
        return []
    return ["", "Teacher-forced on the eval's references (a block anchored every few reference tokens, eval "
                "--teacher-forced-every: training's simulated tau on the eval's own text; the harmonic mean is the "
                "decoding-walk estimate):", "",
            "| method | set | decoded tau | teacher-forced tau | harmonic mean (walk) |", "|---|---|---:|---:|---:|",
            *rows]


def _lookup_split_table(summary: dict) -> list[str]:
    """Each drafter against prompt lookup on the prompts where lookup's own tau is low (little to copy) and on
    the rest (repeated text: lookup proposes whole blocks)."""
    rows, at = [], None
    for s, row in summary["sets"].items():
        for name, r in row.get("drafters", {}).items():
            sp = r.get("lookup_split")
            if not sp:
                continue
            at = sp["at"]
            lo, hi = sp["below"], sp["at_or_above"]
            rows.append(f"| {name} | {s} | {lo['prompts']} | {_f(lo['method_tau'])} | {_f(lo['lookup_tau'])} | "
                        f"{hi['prompts']} | {_f(hi['method_tau'])} | {_f(hi['lookup_tau'])} |")
    if not rows:
        return []
    return ["", f"DFlash and prompt lookup split by lookup's own tau per prompt (below {at}: little repeated text to "
                "copy; at or above: lookup copies whole blocks):", "",
            f"| drafter | set | prompts, lookup < {at} | DFlash tau | lookup tau | prompts, lookup >= {at} | "
            "DFlash tau | lookup tau |", "|---|---|---:|---:|---:|---:|---:|---:|", *rows]


def _turn_table(summary: dict) -> list[str]:
    """Each drafter against prompt lookup on MT-Bench's first and second turns (a second turn repeats the first
    answer: lookup copies it)."""
    rows = []
    for s, row in summary["sets"].items():
        for name, r in row.get("drafters", {}).items():
            for turn, t in sorted((r.get("turn_split") or {}).items()):
                ratio = t["method_tau"] / t["lookup_tau"] if t["method_tau"] and t["lookup_tau"] else None
                rows.append(f"| {name} | {s} | {turn} | {t['prompts']} | {_f(t['method_tau'])} | "
                            f"{_f(t['lookup_tau'])} | {_f(ratio, '.2f', 'x')} |")
    if not rows:
        return []
    return ["", "DFlash and prompt lookup per turn:", "",
            "| drafter | set | turn | prompts | DFlash tau | lookup tau | DFlash / lookup |",
            "|---|---|---:|---:|---:|---:|---:|", *rows]


def _copy_table(summary: dict) -> list[str]:
    """Teacher-forced blocks grouped by how much prompt lookup copied at the same anchor: the drafter's tau there."""
    rows = []
    for s, row in summary["sets"].items():
        for name, r in row.get("drafters", {}).items():
            for b in r.get("copy_bins") or []:
                lo, hi = b["lookup_matched"]
                rows.append(f"| {name} | {s} | {lo if lo == hi else f'{lo}-{hi}'} | {b['blocks']} | "
                            f"{_f(b['lookup_tau'], '.2f')} | {_f(b['method_tau'], '.2f')} | "
                            f"{_f(b['method_whole'], '.1%')} |")
    if not rows:
        return []
    return ["", "Teacher-forced blocks by the drafts prompt lookup matched at the same anchor (15 = a whole block "
                "copied): does the drafter copy there too?", "",
            "| drafter | set | lookup matched | blocks | lookup tau | DFlash tau | DFlash whole blocks |",
            "|---|---|---:|---:|---:|---:|---:|", *rows]


def _anchors(tr: dict) -> str:
    """', 975 real anchors a step of 1024' where the step records carry the count (metrics.jsonl, session 21+)."""
    if tr.get("anchors_mean") is None:
        return ""
    return f", {tr['anchors_mean']:,.0f} real anchors a step of {tr.get('num_anchors') or '?'}"


def _pct(p: dict | None) -> str:
    return "-" if not p else f"{p['diff']:+.2%} [{p['ci95'][0]:+.2%}, {p['ci95'][1]:+.2%}]"


def markdown(summary: dict) -> str:
    L = ["# Quality report (issues 5, 19): SmolLM2-135M-Instruct target, DFlash drafters against prompt lookup", ""]
    g, R = summary["goals"], summary["runs"]
    if not g["complete"]:
        L += [f"**Partial**: stages done: {', '.join(summary['stages_done']) or 'none'}.", ""]
    L += ["| drafter | set | prompts | DFlash tau | prompt-lookup tau | DFlash / lookup | identical to target | "
          "simulated tau: training batches (last 10 %) | simulated tau: held-out val cache (last pass) |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    walk = lambda x: f" (walk {x:.2f})" if x is not None else ""  # noqa: E731 - the decoding-walk estimate
    for name in [n for n in R if not n.startswith("scale-")]:
        tr, va = R[name]["train"], R[name]["val"]
        sim = (f"{_f(tr and tr['tau_last_10pct'], '.2f')}{walk(tr and tr.get('tau_walk_last_10pct'))} | "
               f"{_f(va and va['tau_last'], '.2f')}{walk(va and va.get('tau_walk_last'))}")
        for s in SETS:
            row = summary["sets"].get(s, {})
            r = row.get("drafters", {}).get(name)
            if not r:
                L.append(f"| {name} | {s} | - | - | - | - | - | {sim} |")
                continue
            L.append(f"| {name} | {s} | {row['prompts']}{' (partial)' if row['partial'] else ''} | {_f(r['tau'])} | "
                     f"{_f(row['ngram_tau'])} | "
                     f"{_f(r['ratio_vs_lookup'], '.2f', 'x')} | {_f(r['identical'], '.0%')} | {sim} |")
    L += ["", "The 'heldout' set decodes the first data.skip_samples regenerated conversations (never trained on); "
              "the held-out simulated tau is measured on the same documents' cached features (cache-val)."]
    L += _teacher_forced_table(summary)
    L += _lookup_split_table(summary)
    L += _turn_table(summary)
    L += _copy_table(summary)
    met = {True: "**met**", False: "**not met**", None: "not yet measured"}
    L += ["", f"DFlash vs prompt lookup, goal >= 2x on MT-Bench and HumanEval: {met[g['dflash_vs_lookup_2x_met']]} "
              f"(lowest ratio {_f(g['dflash_vs_lookup_min_ratio'], '.2f', 'x')}).", ""]
    g19 = g.get("issue19") or {}
    if g19:
        sets19 = "; ".join(f"{s} {_f(v['ratio'], '.2f', 'x')} (goal >= {v['goal']}x: {met[v['met']]})"
                           for s, v in g19["sets"].items())
        L += [f"Issue 19: DFlash ({REFERENCE}) vs prompt lookup: {sets19}. Unique supervised training tokens "
              f"(cache-{REFERENCE}): {_tokens(g19['supervised_tokens']) if g19['supervised_tokens'] else '-'} "
              f"(goal >= 30M: {met[g19['tokens_met']]}).", ""]
        f8 = g19.get("fp8")
        if f8:
            per = "; ".join(f"{s} {v['diff']:+.2%} [{v['ci95'][0]:+.2%}, {v['ci95'][1]:+.2%}]"
                            for s, v in f8["sets"].items())
            L += [f"Issue 19: fp8 ({f8['run']}) vs {REFERENCE}, paired: {per or '-'} (goal: every interval within "
                  f"+-1.5 %: {met[f8['met']]}).", ""]
    others = [n for n in R if n != REFERENCE]
    if others:
        L += [f"Every drafter against the {REFERENCE} one, tau(drafter) / tau({REFERENCE}) - 1: decoded on the same "
              "prompts (paired; 95 % bootstrap interval over prompts) and simulated on the held-out cache:", "",
              "| drafter | " + " | ".join(SETS) + " | held-out simulated tau |", "|---|" + "---:|" * (len(SETS) + 1)]
        for n in others:
            L.append(f"| {n} | " + " | ".join(_pct(summary["sets"].get(s, {}).get("vs_reference", {}).get(n))
                                              for s in SETS) +
                     f" | {_f(summary['val_vs_reference'].get(n), '+.2%')} |")
        L += ["", "seed<N>: the same lossless cache and settings with another --seed, i.e. the difference that training "
                  "noise alone makes; scale-<subset>: fewer unique training documents (table below); var-<name>: "
                  "another training recipe on the lossless cache."]
        recipes = [(n, R[n].get("recipe_vs_reference")) for n in others if R[n].get("recipe_vs_reference") is not None]
        if recipes:
            L += ["", f"What each run changes against {REFERENCE} (resolved_config.toml, paths aside):", ""]
            same = "the same [drafter] and [train] settings"
            L += [f"- {n}: " + (", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()) or same)
                  for n, diff in recipes]
    L += ["", f"fp8 vs lossless, goal within 1 % (eval tau, MT-Bench and HumanEval): {met[g['fp8_within_1pct_met']]} "
              f"(largest difference {_f(g['fp8_vs_lossless_max_abs'], '.2%')}).", ""]
    for c in CODECS:
        tr = (R.get(c) or {}).get("train")
        if not tr:
            continue
        start = (f"; started from the drafter in {tr['init_from']} (train --init-from), seed {tr.get('seed')}, peak "
                 f"lr {tr.get('lr')}: the tokens and steps below are this pass's only" if tr.get("init_from") else "")
        L += [f"Simulated tau against training tokens, {c} ({tr['last_step']}"
              f"{'/' + str(tr['planned_steps']) if tr['planned_steps'] else ''} steps, median "
              f"{tr['median_step_s'] * 1000:.0f} ms/step{_anchors(tr)}{start}):", "",
              "| steps | " + " | ".join(f"{w['steps'][0]}-{w['steps'][1]}" for w in tr["windows"]) + " |",
              "|---|" + "---:|" * len(tr["windows"]),
              "| context tokens seen | " + " | ".join(_tokens(w["tokens_seen"]) for w in tr["windows"]) + " |",
              "| simulated tau | " + " | ".join(f"{w['tau']:.3f}" for w in tr["windows"]) + " |",
              "| accuracy | " + " | ".join(f"{w['acc']:.3f}" for w in tr["windows"]) + " |", ""]
        rb = tr.get("round_boundaries")
        if rb:   # window_rounds.jsonl: where the round boundaries' time went
            parts = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in rb.items()
                              if k.endswith("_s") and k not in ("wall_s", "median_wall_s"))
            L += [f"Round boundaries: {rb['boundaries']}, {rb['wall_s']:.1f} s in all (median "
                  f"{rb['median_wall_s']:.2f} s); parts summed (s): {parts}.", ""]
        th = tr.get("threads")
        if th and th.get("threads_ms"):   # the whole run: is the step loop's thread busy all along?
            wait = th.get("device_wait_ms_per_step")
            L += [f"Threads over the run ({th['steps']:,} steps, wall {th['wall_ms_per_step']:.1f} ms a step"
                  + (f", the step loop waiting for the device {wait:.1f} of it" if wait is not None else "")
                  + "), ms a step on a CPU (+ runnable, waiting for one): " + ", ".join(
                      f"{k} {v['cpu']:.1f} (+{v['runnable_wait']:.1f})" for k, v in list(th["threads_ms"].items())[:8])
                  + ".", ""]
        for pr in tr.get("profiled") or []:   # train --profile-steps: the step's own split, from inside the run
            a, b = pr["steps"]
            L += [f"Profiled steps {a}-{b}: wall {pr['wall_ms']:.1f} ms a step, device {pr['device_ms']:.1f} ms, host "
                  f"{pr['cpu_ms']:.1f} ms on the busiest thread (profile/steps_{a}-{b}.txt in results.tar.gz)"
                  + (f"; inside the window, not training steps: {', '.join(pr['inside'])}" if pr.get("inside") else "")
                  + ".", ""]
        va = R[c]["val"]
        if va:
            pts = va["points"]
            pick = [pts[i * (len(pts) - 1) // min(WINDOWS - 1, max(1, len(pts) - 1))] for i in
                    range(min(WINDOWS, len(pts)))]
            L += [f"Held-out simulated tau (validation cache), {c}:", "",
                  "| after step | " + " | ".join(str(st) for st, _ in pick) + " |", "|---|" + "---:|" * len(pick),
                  "| val tau | " + " | ".join(f"{t:.3f}" for _, t in pick) + " |", ""]
    sc = summary.get("data_scaling") or []
    if len(sc) > 1:
        L += ["Held-out tau against unique training data (same steps; scale-* train on a subset of cache-lossless's "
              "shards):", "", "| run | shards | unique context tokens | steps | held-out simulated tau | "
              "(walk) | held-out decoded tau | training tau (last 10 %) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        L += [f"| {r['run']} | {r['shards']} | {_tokens(r['unique_tokens'])} | {r['steps']} | {_f(r['val_tau'])} | "
              f"{_f(r['val_tau_walk'])} | {_f(r['heldout_eval_tau'])} | {_f(r['train_tau_last_10pct'])} |" for r in sc]
        L.append("")
    rg = summary.get("regenerate")
    if rg:
        st = rg.get("settings") or {}
        what = ("ShareGPT first turns" if st.get("mode", "first-turn") != "multi-turn" else
                "ShareGPT conversations, every turn,")
        greedy_after = (f", greedy after {st['greedy_after']} sampled tokens" if st.get("greedy_after") else "")
        how = (f" ({st['samples']} samples each, temperature {st.get('temperature')}, top-p {st.get('top_p')}"
               f"{greedy_after}, max_length {st.get('max_length')})" if int(st.get("samples") or 1) > 1 else "")
        if rg.get("duplicate_rows"):
            how += (f" ({rg['duplicate_rows']} rows repeat an earlier sample of their conversation: "
                    f"{rg['duplicate_tokens']:,} of the generated tokens are not unique)")
        L.append(f"- Data: SmolLM2 answered {rg['rows_written']} {what} itself{how} ({rg['skipped']} skipped, "
                 f"{rg['generated_tokens']:,} tokens generated, {rg['truncated_responses']} hit "
                 f"{st.get('max_new_tokens')} tokens) in {rg['seconds']:.0f} s (summed over the runs that wrote it)"
                 + (f"; stopped at its {rg['capped_at_s']} s cap (QUALITY_REGEN_MAX_S), so the data are the rows "
                    "written by then, a prefix of the prompts." if rg.get("capped_at_s") else "."))
        mo = summary.get("regenerate_more")
        if mo:
            first, n = int(mo.get("first_sample") or 0), int(mo.get("samples") or 1)
            L.append(f"- More data (regen-more, regenerated-more.jsonl): answers #{first}-#{first + n - 1} of the "
                     f"conversations after the held-out ones, {mo['rows_written']} rows, {mo['generated_tokens']:,} "
                     f"tokens generated in {mo['seconds']:.0f} s.")
        tm = rg.get("timing") or {}
        if tm:
            L.append("- Regenerate time split (s): " + ", ".join(f"{k} {v:.1f}" if isinstance(v, (int, float))
                                                                else f"{k} {v}" for k, v in tm.items()) + ".")
    for c, cf in summary["caches"].items():
        if cf:
            extra = (f", fp8 rel. L2 mean {_f(cf.get('fp8_rel_l2_mean'), '.2%')}, max {_f(cf.get('fp8_rel_l2_max'), '.2%')}, "
                     f"cosine >= {_f(cf.get('fp8_cos_min'), '.5f')}" if "fp8_rel_l2_mean" in cf else "")
            L.append(f"- Cache {c}: {cf['docs']} documents, {cf['tokens']:,} tokens ({cf['supervised_tokens']:,} "
                     f"supervised), {cf['bytes'] / 2**30:.2f} GiB = {_f(cf['ratio_to_raw'])} of raw{extra}.")
    for s in SETS:
        r = summary["sets"].get(s)
        if r:
            L.append(f"- Eval {s}: {r['prompts']} prompts x {r['max_new_tokens']} new tokens, greedy; tok/s target "
                     f"{_f(r['target_tok_s'], '.1f')}, lookup {_f(r['ngram_tok_s'], '.1f')}, DFlash " +
                     ", ".join(f"{n} {_f(x['tok_s'], '.1f')}" for n, x in r["drafters"].items()) +
                     " (eval processes shared the GPU: not speed claims).")
    if summary["stage_seconds"]:
        L.append("- Stage wall times (s, summed over calls): " +
                 ", ".join(f"{k} {v}" for k, v in summary["stage_seconds"].items()) + ".")
    return "\n".join(L) + "\n"


def plot(summary: dict, d: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETS) + 1, figsize=(6 * (len(SETS) + 1), 4.2))
    nan = float("nan")
    for ax, s in zip(axes, SETS):
        row = summary["sets"].get(s, {})
        for i, (name, r) in enumerate(row.get("drafters", {}).items()):
            acc = r["acceptance"]
            ax.plot(range(1, len(acc) + 1), [a if a is not None else nan for a in acc], "-" + "osD^v<>"[i % 7],
                    ms=3, label=f"DFlash {name} (tau {_f(r['tau'], '.2f')})")
        if row.get("ngram_acceptance"):
            acc = row["ngram_acceptance"]
            ax.plot(range(1, len(acc) + 1), [a if a is not None else nan for a in acc], "--x", ms=3,
                    color="gray", label=f"prompt lookup (tau {_f(row['ngram_tau'], '.2f')})")
        ax.set_title(f"{s}: acceptance through block position k")
        ax.set_xlabel("k")
        ax.set_ylim(0, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax = axes[-1]
    for name, run in runs(d).items():
        tr, va = training_curve(run), validation_curve(run)
        if not tr:
            continue
        xs, ys = zip(*tr["points"])
        xs = [x / 1e6 for x in xs]
        w = max(1, len(ys) // 40)                      # rolling mean over ~2.5 % of the records
        smooth = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        line, = ax.plot(xs, smooth, lw=1.4, label=f"{name} training (rolling mean of {w})")
        if va:   # validation points placed at the tokens seen by their step
            per_step = tr["tokens_seen"] / max(1, tr["last_step"])
            ax.plot([st * per_step / 1e6 for st, _ in va["points"]], [t for _, t in va["points"]], "D--", ms=4,
                    color=line.get_color(), label=f"{name} held-out (val cache)")
    ax.set_xlabel("context tokens seen (M)")
    ax.set_ylabel("simulated tau")
    ax.set_title("simulated tau vs training tokens")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def pack(d: Path, out_tar: Path, extra: tuple[Path, ...] = ()) -> None:
    """results.tar.gz: what the report read under `d`, the logs' tails, and `extra` files (quality.png: the device
    brings back 8 files a call, and the PNG is the first left out when a call has more)."""
    # the regenerated rows themselves leave as $OUT/regen_rows_*.tar (bench/regen_seed.py ship): at tens of M
    # tokens they would push this archive past what a call brings back (16 MiB a file)
    names = ["regenerated.jsonl.progress.json", "regenerated-more.jsonl.progress.json", "cache-val/manifest.json"]
    for c in CODECS:
        names += [f"cache-{c}/manifest.json", f"cache-{c}/resolved_config.toml"]
    for run in runs(d).values():
        names += [f"{run.name}/{n}" for n in ("metrics.jsonl", "val_metrics.jsonl", "training.png", "resolved_config.toml",
                                             "export/config.json", "latest.json", "window_rounds.jsonl",
                                             "thread_times.json")]
        names += [f"{run.name}/profile/{p.name}" for p in sorted((run / "profile").glob("steps_*"))]  # --profile-steps
    for sub in sorted(d.glob("eval-*")):
        names += [f"{sub.name}/{n}" for n in ("eval_report.json", "eval_report.md", "eval_prompts.jsonl",
                                              "acceptance.png", "resolved_config.toml",
                                              "eval_progress.jsonl")]   # an unfinished eval's prompts so far
    tmp = out_tar.with_name(out_tar.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for n in names:
            p = d / n
            if p.is_file():
                tar.add(p, arcname=f"quality/{n}")
        for p in extra:
            if p.is_file():
                tar.add(p, arcname=f"quality/{p.name}")
        for p in sorted((d / "logs").glob("*.log")):
            data = p.read_bytes()[-LOG_TAIL_BYTES:]
            info = tarfile.TarInfo(f"quality/logs/{p.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out_tar)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/quality"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = build(args.dir)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    md = markdown(summary)
    (args.out / "summary.md").write_text(md)
    png = args.out / "quality.png"
    try:
        plot(summary, args.dir, png)
    finally:   # the archive is written whether or not the plot was
        pack(args.dir, args.out / "results.tar.gz", extra=(png,))
    print(md, end="")


if __name__ == "__main__":
    main()
