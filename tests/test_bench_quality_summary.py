"""bench/quality_summary.py: the paired comparison of two drafters decoded on the same prompts, and the
report rebuilt from an unfinished eval's progress file."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("quality_summary", Path(__file__).parents[1] / "bench" / "quality_summary.py")
qr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qr)
import lookup_compare as lc  # noqa: E402 - bench/ is on the path once quality_summary is loaded


def test_paired_difference_is_the_ratio_of_pooled_taus_and_its_interval_brackets_it():
    rng = random.Random(1)
    a = {f"p{i}": (255, rng.randint(100, 160)) for i in range(40)}      # (committed tokens, verify steps)
    b = {k: (t, max(1, s - rng.randint(-3, 12))) for k, (t, s) in a.items()}
    b["only-in-b"] = (255, 1)                                           # not decoded by both: ignored
    got = qr.paired(a, b)
    tau_a = sum(t for t, _ in a.values()) / sum(s for _, s in a.values())
    tau_b = sum(b[k][0] for k in a) / sum(b[k][1] for k in a)
    assert got["prompts"] == 40
    assert got["diff"] == pytest.approx(tau_b / tau_a - 1, rel=1e-12)
    lo, hi = got["ci95"]
    assert lo < got["diff"] < hi and hi - lo < 0.1
    assert qr.paired(a, b) == got                                       # seeded: reproducible
    same = qr.paired(a, dict(a))
    assert same["diff"] == 0 and same["ci95"] == [0, 0]
    assert qr.paired(a, {"x": (1, 1)}) is None


def test_per_prompt_counts_come_from_eval_prompts_jsonl(tmp_path):
    rows = [{"set": "heldout", "id": "7", "method": "target", "generated": 9},
            {"set": "heldout", "id": "7", "method": "dflash:fp8", "generated": 9, "steps": 4},
            {"set": "heldout", "id": "8", "method": "dflash:fp8", "generated": 1, "steps": 0}]   # EOS at once
    (tmp_path / "eval_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert qr.per_prompt(tmp_path) == {"dflash:fp8": {"7": (8, 4)}}


def test_an_unfinished_eval_counts_with_its_finished_prompts(tmp_path):
    from dflash_pipe.eval import SpecResult
    from dflash_pipe.eval.progress_log import EvalProgress

    ev = tmp_path / "eval-heldout"
    prog = EvalProgress(ev, "key")
    fast = SpecResult([1, 2, 3, 4, 5, 6, 7], 4, proposed=[3, 3], accepted=[3, 1], slot_limit=[3, 3], committed=[4, 2])
    slow = SpecResult([1, 2, 3, 4, 5, 6, 7], 4, proposed=[3] * 6, accepted=[0] * 6, slot_limit=[3] * 6,
                      committed=[1] * 6)
    prog.add("heldout", "p0", [9], [1, 2, 3, 4, 5, 6, 7], 0.1, {"dflash:lossless": fast, "dflash:fp8": slow})
    prog.add("heldout", "p1", [8], [1, 2, 3, 4, 5, 6, 7], 0.1, {"dflash:lossless": slow, "dflash:fp8": slow})
    (ev / "eval_progress.jsonl").open("a").write('{"key": "key", "set": "held')       # a line cut by a kill
    got = qr.eval_sets(tmp_path)["heldout"]
    assert got["partial"] and got["set"]["prompts"] == 2
    assert got["set"]["dflash:lossless"]["tau"] == (6 + 6) / (2 + 6)                  # pooled over the two prompts
    assert got["set"]["dflash:fp8"]["tau"] == 1.0
    assert got["set"]["dflash:lossless"]["acceptance"] == [2 / 8, 1 / 8, 1 / 8]       # a >= k in 2, 1, 1 of 8 steps
    assert got["prompts"]["dflash:fp8"] == {"p0": (6, 6), "p1": (6, 6)}
    assert qr.paired(got["prompts"]["dflash:lossless"], got["prompts"]["dflash:fp8"])["diff"] == 1.0 / 1.5 - 1


def _run(d: Path, name: str, *, seed=0, kd=0.0, shards="", val_tau=2.0):
    run = d / name
    run.mkdir()
    (run / "resolved_config.toml").write_text(
        f'[drafter]\nnum_layers = 3\nblock_size = 16\n\n[train]\noutput_dir = "{run}"\ncache_dir = "{d}/cache-lossless"\n'
        f'seed = {seed}\nkd_weight = {kd}\nshards = "{shards}"\nmax_steps = 100\n\n[eval]\nmax_prompts = {seed + 5}\n')
    (run / "val_metrics.jsonl").write_text(json.dumps({"step": 99, "val_tau": val_tau, "val_tau_walk": 1.5}) + "\n")
    return run


def test_recipe_variants_are_compared_with_lossless_but_kept_out_of_data_scaling(tmp_path):
    (tmp_path / "cache-lossless").mkdir()
    (tmp_path / "cache-lossless" / "manifest.json").write_text(json.dumps(
        {"shards": [{"index": i, "tokens": 1000 * (i + 1)} for i in range(4)]}))
    _run(tmp_path, "train-lossless", val_tau=2.0)
    _run(tmp_path, "train-seed1", seed=1, val_tau=2.1)
    _run(tmp_path, "var-kd5", kd=0.5, val_tau=2.4)
    _run(tmp_path, "scale-0_1", shards="0-1", val_tau=1.5)
    assert list(qr.runs(tmp_path)) == ["lossless", "seed1", "var-kd5", "scale-0_1"]
    ref = tmp_path / "train-lossless"
    # paths and the [eval] table differ too, and are not part of the recipe
    assert qr.recipe_diff(tmp_path / "var-kd5", ref) == {"train.kd_weight": [0.0, 0.5]}
    assert qr.recipe_diff(tmp_path / "train-seed1", ref) == {"train.seed": [0, 1]}
    assert qr.recipe_diff(tmp_path / "scale-0_1", ref) == {"train.shards": ["", "0-1"]}
    assert qr.recipe_diff(tmp_path / "missing", ref) is None
    scaling = qr.data_scaling(tmp_path, {})
    assert [(r["run"], r["unique_tokens"], r["val_tau"]) for r in scaling] == [
        ("scale-0_1", 1000 + 2000, 1.5), ("lossless", 10000, 2.0), ("seed1", 10000, 2.1)]
    summary = qr.build(tmp_path)
    assert summary["runs"]["var-kd5"]["recipe_vs_reference"] == {"train.kd_weight": [0.0, 0.5]}
    assert "recipe_vs_reference" not in summary["runs"]["lossless"]
    assert summary["val_vs_reference"]["var-kd5"] == pytest.approx(2.4 / 2.0 - 1)


def test_issue19_goals_use_each_sets_bar_and_the_supervised_tokens():
    """heldout needs 1.5x prompt lookup, MT-Bench and HumanEval 1.2x; a partial set is not judged."""
    def row(ratio, partial=False):
        return {"prompts": 10, "partial": partial, "drafters": {"lossless": {"ratio_vs_lookup": ratio}}}

    summary = {"sets": {"heldout": row(1.49), "mtbench": row(1.2), "humaneval": row(1.9, partial=True)},
               "caches": {"lossless": {"supervised_tokens": 31_000_000}}}
    g = qr.issue19_goals(summary)
    assert {s: v["met"] for s, v in g["sets"].items()} == {"heldout": False, "mtbench": True, "humaneval": None}
    assert g["tokens_met"] is True and g["supervised_tokens"] == 31_000_000
    summary["caches"]["lossless"]["supervised_tokens"] = 29_999_999
    summary["sets"].pop("mtbench")
    g = qr.issue19_goals(summary)
    assert g["tokens_met"] is False and g["sets"]["mtbench"] == {"ratio": None, "goal": 1.2, "prompts": None,
                                                                  "met": None}


def test_issue19_fp8_goal_finds_the_feature_codec_variant_and_judges_each_interval():
    def vs(diff, lo, hi):
        return {"prompts": 10, "diff": diff, "ci95": [lo, hi]}

    summary = {"runs": {"lossless": {}, "var-l5": {"recipe_vs_reference": {"drafter.num_layers": [3, 5]}},
                        "var-fp8": {"recipe_vs_reference": {"train.feature_codec": ["stored", "fp8"]}}},
               "sets": {s: {"prompts": 10, "drafters": {}, "vs_reference": {"var-fp8": vs(0.004, -0.01, 0.018)}}
                        for s in ("heldout", "mtbench", "humaneval")},
               "caches": {}}
    g = qr.issue19_goals(summary)["fp8"]
    assert g["run"] == "var-fp8" and g["met"] is True
    assert g["sets"]["heldout"]["half_width"] == pytest.approx(0.014)
    summary["sets"]["humaneval"]["vs_reference"]["var-fp8"] = vs(0.0, -0.02, 0.011)   # half-width 1.55 %
    g = qr.issue19_goals(summary)["fp8"]
    assert g["met"] is False and g["sets"]["humaneval"]["met"] is False and g["sets"]["mtbench"]["met"] is True
    summary["sets"]["mtbench"]["partial"] = True
    assert qr.issue19_goals(summary)["fp8"]["met"] is None
    summary["runs"].pop("var-fp8")
    assert qr.issue19_goals(summary)["fp8"] is None


def test_lookup_split_pools_each_side_by_lookups_own_tau():
    counts = {"ngram": {"a": (10, 10), "b": (30, 10), "c": (15, 10), "d": (16, 10)},      # lookup tau 1, 3, 1.5, 1.6
              "dflash:x": {"a": (20, 10), "b": (20, 10), "c": (18, 9), "d": (10, 10), "e": (50, 10)}}
    sp = lc.lookup_split(counts, "dflash:x")
    assert sp["at"] == 1.6
    assert sp["below"] == {"prompts": 2, "method_tau": pytest.approx(38 / 19), "lookup_tau": pytest.approx(25 / 20)}
    assert sp["at_or_above"] == {"prompts": 2, "method_tau": pytest.approx(30 / 20), "lookup_tau": pytest.approx(46 / 20)}
    assert lc.lookup_split({"dflash:x": counts["dflash:x"]}, "dflash:x") is None       # no lookup records
    assert lc.pooled_tau(counts["ngram"], []) is None


def test_turn_split_pools_mtbench_first_and_second_turns_and_the_report_shows_them():
    counts = {"ngram": {"m/81": (20, 10), "m/81/turn2": (40, 10), "m/82": (10, 10), "m/82/turn2": (30, 10)},
              "dflash:x": {"m/81": (25, 10), "m/81/turn2": (35, 10), "m/82": (15, 10), "m/82/turn2": (33, 11)}}
    sp = lc.turn_split(counts, "dflash:x")
    assert sp["1"] == {"prompts": 2, "method_tau": pytest.approx(40 / 20), "lookup_tau": pytest.approx(30 / 20)}
    assert sp["2"] == {"prompts": 2, "method_tau": pytest.approx(68 / 21), "lookup_tau": pytest.approx(70 / 20)}
    single = {m: {k: v for k, v in c.items() if not k.endswith("/turn2")} for m, c in counts.items()}
    assert lc.turn_split(single, "dflash:x") is None                                    # one turn: no split
    import quality_report

    summary = {"sets": {"mtbench": {"drafters": {"x": {"turn_split": sp}}}, "humaneval": {"drafters": {"x": {}}}}}
    table = "\n".join(quality_report._turn_table(summary))
    assert "| x | mtbench | 1 | 2 | 2.000 | 1.500 | 1.33x |" in table and "humaneval" not in table
    assert "| x | mtbench | 2 | 2 | 3.238 | 3.500 | 0.93x |" in table


def test_copy_bins_pair_each_block_with_lookups_at_the_same_anchor():
    rows = [{"set": "s", "id": "g1", "method": "ngram", "scan_matched": [0, 15, 3, 15]},
            {"set": "s", "id": "g1", "method": "dflash:x", "scan_matched": [2, 15, 1, 4]},
            {"set": "s", "id": "g2", "method": "ngram", "scan_matched": [10]},
            {"set": "s", "id": "g2", "method": "dflash:x", "scan_matched": [0]},
            {"set": "s", "id": "g3", "method": "dflash:x", "scan_matched": [9]},          # no lookup record: out
            {"set": "t", "id": "g1", "method": "ngram", "scan_matched": [15]}]           # another set
    bins = lc.copy_bins(lc.teacher_forced_scans(rows, "s"), "dflash:x")
    by = {tuple(b["lookup_matched"]): b for b in bins}
    assert [b["blocks"] for b in bins] == [1, 1, 1, 2]
    assert by[(0, 0)]["method_tau"] == 3 and by[(1, 7)]["method_tau"] == 2 and by[(8, 14)]["lookup_tau"] == 11
    assert by[(15, 15)] == {"lookup_matched": [15, 15], "blocks": 2, "lookup_tau": 16, "method_tau": (16 + 5) / 2,
                            "method_whole": 0.5}
    assert lc.copy_bins(lc.teacher_forced_scans(rows, "t"), "dflash:x") is None


def report_module():
    """bench/quality_report.py, loaded with bench/ on the path for its sibling imports."""
    import sys

    spec = importlib.util.spec_from_file_location("quality_report", Path(__file__).parents[1] / "bench" / "quality_report.py")
    rep = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        spec.loader.exec_module(rep)
    finally:
        sys.path.remove(str(Path(__file__).parents[1] / "bench"))
    return rep


def test_the_report_sets_teacher_forced_tau_beside_the_decoded_one():
    """eval --teacher-forced-every: bench/quality_report.py tabulates each method's scan beside its decoded tau (and
    leaves the table out when no eval scanned)."""
    rep = report_module()
    row = {"ngram_tau": 2.2, "ngram_teacher_forced": {"tau": 2.9, "tau_walk": 1.6, "blocks": 100},
           "drafters": {"lossless": {"tau": 1.9, "teacher_forced": {"tau": 3.2, "tau_walk": 1.7, "blocks": 100}}}}
    lines = rep._teacher_forced_table({"sets": {"heldout": row}})
    assert "| lossless | heldout | 1.900 | 3.200 | 1.700 |" in lines
    assert "| prompt lookup | heldout | 2.200 | 2.900 | 1.600 |" in lines
    row["drafters"]["lossless"]["teacher_forced"] = row["ngram_teacher_forced"] = None
    assert rep._teacher_forced_table({"sets": {"heldout": row}}) == []


def test_a_later_pass_says_which_drafter_it_started_from(tmp_path):
    """train --init-from (issue 19's second pass): the summary keeps the starting drafter, seed and lr, so a report
    of a pass cannot be read as a drafter trained from scratch on its tokens."""
    run = tmp_path / "train-lossless"
    run.mkdir()
    recs = [{"step": i, "tau": 2.0 + i / 100, "acc": 0.5, "loss": 2.0, "tok_s": 1000.0, "step_s": 0.08}
            for i in range(20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = '[train]\nmax_steps = 20\nseed = 1\nlr = 0.0004\ninit_from = "/tmp/quality/init/lossless"\n'
    (run / "resolved_config.toml").write_text(cfg)
    tr = qr.training_curve(run)
    assert (tr["init_from"], tr["seed"], tr["lr"]) == ("/tmp/quality/init/lossless", 1, 0.0004)
    (run / "resolved_config.toml").write_text(cfg.replace('init_from = "/tmp/quality/init/lossless"', 'init_from = ""'))
    assert qr.training_curve(run)["init_from"] is None                  # a first pass: nothing to say


def test_the_summary_and_report_give_the_real_anchors_a_step(tmp_path):
    """Step records with `anchors` (session 21+): their mean beside --num-anchors in the summary and the report's
    training line; older records without it: nothing said."""
    run = tmp_path / "train-lossless"
    run.mkdir()
    recs = [{"step": i, "tau": 2.0, "acc": 0.5, "loss": 2.0, "tok_s": 1000.0, "step_s": 0.08, "anchors": 900 + i}
            for i in range(21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "resolved_config.toml").write_text("[train]\nmax_steps = 21\nnum_anchors = 1024\n")
    tr = qr.training_curve(run)
    assert (tr["anchors_mean"], tr["num_anchors"]) == (910.0, 1024)
    rep = report_module()
    assert rep._anchors(tr) == ", 910 real anchors a step of 1024"
    for r in recs:
        del r["anchors"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert rep._anchors(qr.training_curve(run)) == ""


def test_the_summary_and_report_sum_the_round_boundaries(tmp_path):
    """window_rounds.jsonl (train/round_clock.py): the summary sums each part over the boundaries, the report says
    it under the training table; a run without the file (before session 24) says nothing."""
    run = tmp_path / "train-lossless"
    run.mkdir()
    recs = [{"step": i, "tau": 2.0, "acc": 0.5, "loss": 2.0, "tok_s": 1000.0, "step_s": 0.05} for i in range(20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "resolved_config.toml").write_text("[train]\nmax_steps = 20\n")
    assert qr.training_curve(run)["round_boundaries"] is None
    rounds = [{"round": r, "step": 5 * r, "wall_s": 0.4 + r / 10, "drain_s": 0.05, "snapshot_s": 0.1 * (r % 2),
               "collect_s": 0.2} for r in range(1, 4)]
    (run / "window_rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    rb = qr.training_curve(run)["round_boundaries"]
    assert rb["boundaries"] == 3 and rb["median_wall_s"] == pytest.approx(0.6)
    assert (rb["wall_s"], rb["drain_s"], rb["snapshot_s"], rb["collect_s"]) == pytest.approx((1.8, 0.15, 0.2, 0.6))
    md = report_module().markdown(qr.build(tmp_path))
    assert "Round boundaries: 3, 1.8 s in all (median 0.60 s); parts summed (s): drain 0.15, snapshot 0.20, " \
           "collect 0.60." in md
    # train --profile-steps: each profiled window's split under the table, and its files in results.tar.gz
    (run / "profile").mkdir()
    (run / "profile" / "steps_100-120.json").write_text(json.dumps(
        {"steps": [100, 120], "wall_ms": 47.94, "device_ms": 21.5, "cpu_ms": 40.26, "cpu_ms_other_threads": [3.0]}))
    (run / "profile" / "steps_100-120.txt").write_text("tables\n")
    md = report_module().markdown(qr.build(tmp_path))
    assert "Profiled steps 100-120: wall 47.9 ms a step, device 21.5 ms, host 40.3 ms on the busiest thread" in md
    (run / "profile" / "steps_200-220.json").write_text(json.dumps(   # a window a validation landed in says so
        {"steps": [200, 220], "wall_ms": 90.0, "device_ms": 30.0, "cpu_ms": 60.0, "cpu_ms_other_threads": [],
         "inside": ["validation after step 210"]}))
    md = report_module().markdown(qr.build(tmp_path))
    assert "results.tar.gz); inside the window, not training steps: validation after step 210." in md
    (run / "thread_times.json").write_text(json.dumps(   # train's CPU time per thread over the run
        {"steps": 1000, "wall_ms_per_step": 55.0, "device_wait_ms_per_step": 3.25, "threads_ms": {"MainThread": {"cpu": 41.5, "runnable_wait": 0.2},
                                                                 "dflash-decode": {"cpu": 12.0, "runnable_wait": 1.0}}}))
    md = report_module().markdown(qr.build(tmp_path))
    assert ("Threads over the run (1,000 steps, wall 55.0 ms a step, the step loop waiting for the device 3.2 of "
            "it), ms a step on a CPU (+ runnable, waiting for one): MainThread 41.5 (+0.2), dflash-decode 12.0 "
            "(+1.0).") in md
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "quality.png").write_bytes(b"png")   # the report's PNG travels inside the archive too
    pngs = (tmp_path / "out" / "quality.png", tmp_path / "out" / "missing.png")
    report_module().pack(tmp_path, tmp_path / "results.tar.gz", extra=pngs)
    import tarfile
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert {"quality/train-lossless/profile/steps_100-120.json", "quality/quality.png",
                "quality/train-lossless/thread_times.json",
                "quality/train-lossless/profile/steps_100-120.txt"} <= set(tar.getnames())
