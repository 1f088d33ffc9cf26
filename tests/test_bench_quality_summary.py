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
    prog.add("heldout", "p0", [1, 2, 3, 4, 5, 6, 7], 0.1, {"dflash:lossless": fast, "dflash:fp8": slow})
    prog.add("heldout", "p1", [1, 2, 3, 4, 5, 6, 7], 0.1, {"dflash:lossless": slow, "dflash:fp8": slow})
    (ev / "eval_progress.jsonl").open("a").write('{"key": "key", "set": "held')       # a line cut by a kill
    got = qr.eval_sets(tmp_path)["heldout"]
    assert got["partial"] and got["set"]["prompts"] == 2
    assert got["set"]["dflash:lossless"]["tau"] == (6 + 6) / (2 + 6)                  # pooled over the two prompts
    assert got["set"]["dflash:fp8"]["tau"] == 1.0
    assert got["set"]["dflash:lossless"]["acceptance"] == [2 / 8, 1 / 8, 1 / 8]       # a >= k in 2, 1, 1 of 8 steps
    assert got["prompts"]["dflash:fp8"] == {"p0": (6, 6), "p1": (6, 6)}
    assert qr.paired(got["prompts"]["dflash:lossless"], got["prompts"]["dflash:fp8"])["diff"] == 1.0 / 1.5 - 1
