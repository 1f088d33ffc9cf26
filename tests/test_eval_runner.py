"""`run_eval` end to end on a tiny target + exported drafter, and the report arithmetic by hand."""

from __future__ import annotations

import json

import pytest

from dflash_pipe.config import RunConfig
from dflash_pipe.drafter import export_drafter
from dflash_pipe.errors import UsageError, ValidationError
from dflash_pipe.eval import SpecResult
from dflash_pipe.eval.report import method_summary, training_tau
from dflash_pipe.eval.runner import run_eval
from tests.eval_helpers import hf_greedy, llama, tiny_drafter  # noqa: F401 - llama is a fixture


def test_method_summary_matches_hand_computation():
    # prompt 1: steps accepted 3, 0, 1 with budgets 3, 3, 2; prompt 2: one step, budget 3, accepted 2
    r1 = SpecResult(tokens=[5] * 8, block_size=4, target_forwards=4, proposed=[3, 3, 2], accepted=[3, 0, 1],
                    slot_limit=[3, 3, 2], committed=[4, 1, 2], wall_s=2.0)
    r2 = SpecResult(tokens=[6] * 4, block_size=4, target_forwards=2, proposed=[3], accepted=[2], slot_limit=[3],
                    committed=[3], wall_s=1.0)
    s = method_summary([r1, r2], [[5] * 8, [7] * 4], target_tok_s=2.0, with_speedup=True)
    assert s["tau"] == pytest.approx((4 + 1 + 2 + 3) / 4)
    # slot 1: a>=1 in 3 of 4 steps; slot 2: a>=2 in 2 of 4; slot 3: a>=3 in 1 of the 3 steps with budget 3
    assert s["acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert s["tokens_per_s"] == pytest.approx(12 / 3.0) and s["speedup"] == pytest.approx(2.0)
    assert s["identical_to_target"] == 0.5 and s["target_forwards"] == 6
    assert method_summary([r1], [[5] * 8], 2.0, with_speedup=False)["speedup"] is None


def test_training_tau_reads_last_and_tail_mean(tmp_path):
    taus = [1.0 + 0.1 * i for i in range(30)]
    lines = [json.dumps({"step": i, "tau": t}) for i, t in enumerate(taus)] + ['{"step": 30, "ta']   # cut line
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    got = training_tau(tmp_path)
    assert got["tau_last"] == pytest.approx(taus[-1])
    assert got["tau_last_10pct_mean"] == pytest.approx(sum(taus[-3:]) / 3)
    assert "tau_walk_last_10pct_mean" not in got and "val_tau" not in got  # older runs log neither
    assert training_tau(tmp_path / "missing") is None
    walks = [1.0 + 0.05 * i for i in range(30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tau": t, "tau_walk": w}) + "\n"
                                                    for i, (t, w) in enumerate(zip(taus, walks))))
    (tmp_path / "val_metrics.jsonl").write_text(json.dumps({"step": 9, "val_tau": 2.5, "val_tau_walk": 1.9}) + "\n" +
                                                json.dumps({"step": 19, "val_tau": 2.7, "val_tau_walk": 2.0}) + "\n")
    got = training_tau(tmp_path)
    assert got["tau_walk_last_10pct_mean"] == pytest.approx(sum(walks[-3:]) / 3)
    assert (got["val_step"], got["val_tau"], got["val_tau_walk"]) == (20, 2.7, 2.0)


def _cfg(tmp_path, **eval_kw) -> RunConfig:
    cfg = RunConfig()
    cfg.target.model = "random:tiny-llama"
    cfg.train.output_dir = str(tmp_path / "train")
    cfg.eval.device = "cpu"
    cfg.eval.prompts = "mtbench,humaneval"
    cfg.eval.max_prompts = 2
    cfg.eval.max_new_tokens = 12
    cfg.eval.mtbench_turns = 1                  # 2 (the default) in the end-to-end and resume tests only: time
    for k, v in eval_kw.items():
        setattr(cfg.eval, k, v)
    return cfg


def test_run_eval_end_to_end(llama, tmp_path, capsys):
    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp_path / "train" / "export")             # the default location
    (tmp_path / "train" / "metrics.jsonl").write_text(json.dumps({"step": 0, "tau": 1.5}) + "\n")
    report = run_eval(_cfg(tmp_path, mtbench_turns=2), bundle=llama)
    out = tmp_path / "train" / "eval"
    on_disk = json.loads((out / "eval_report.json").read_text())
    assert on_disk["sets"].keys() == {"mtbench", "humaneval"} == report["sets"].keys()
    assert on_disk["training"]["dflash"]["tau_last"] == 1.5
    records = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    from dflash_pipe.data import load_prompts
    from dflash_pipe.eval import eos_token_ids
    from dflash_pipe.eval.runner import encode_prompt

    eos = eos_token_ids(llama.model, llama.tokenizer)
    for name, s in on_disk["sets"].items():
        turns = 2 if name == "mtbench" else 1                     # MT-Bench: both turns by default
        assert s["prompts"] == 2 and s["generations"] == 2 * turns and s["skipped_ids"] == []
        mine = [r for r in records if r["set"] == name]
        for m in ("dflash", "ngram"):
            rows = [r for r in mine if r["method"] == m]
            assert len(rows) == 2 * turns and all(r["identical_to_target"] for r in rows)
            assert all(r["verify_s"] > 0 and r["draft_s"] >= 0 and r["verify_s"] + r["draft_s"] < r["wall_s"]
                       for r in rows)
            assert s[m]["other_s"] == pytest.approx(s[m]["wall_s"] - s[m]["verify_s"] - s[m]["draft_s"]
                                                    - s[m]["prefill_s"], abs=1e-9)
            assert s[m]["identical_to_target"] == 1.0
            steps = sum(r["steps"] for r in rows)
            assert s[m]["steps"] == steps
            assert s[m]["tau"] == pytest.approx(sum(r["generated"] - 1 for r in rows) / steps)
            assert all(0.0 <= a <= 1.0 for a in s[m]["acceptance"]) and len(s[m]["acceptance"]) == 3
        # the target-only outputs are transformers' greedy outputs for the same chat-templated prompts
        targets = {r["id"]: r for r in mine if r["method"] == "target"}
        for prompt in load_prompts(name, 2, mtbench_turns=2):
            ids = encode_prompt(llama.tokenizer, prompt.messages)
            first = hf_greedy(llama.model, ids, 12, eos)
            assert targets[prompt.id]["generated"] == len(first)
            if name == "mtbench":  # turn 2 is asked after the target's own first answer
                msgs = prompt.messages + [{"role": "assistant", "content": llama.tokenizer.decode(
                    first, skip_special_tokens=True)}, {"role": "user", "content": prompt.followups[0]}]
                second = hf_greedy(llama.model, encode_prompt(llama.tokenizer, msgs), 12, eos)
                assert targets[f"{prompt.id}/turn2"]["generated"] == len(second)
    md = (out / "eval_report.md").read_text()
    assert "| mtbench | 2 (4 turns) | DFlash |" in md and "DFlash: training-time simulated tau: last 1.50" in md
    assert (out / "acceptance.png").stat().st_size > 1000
    assert "| humaneval | 2 |" in capsys.readouterr().out


def test_prompts_longer_than_the_context_are_skipped_counted_and_named(llama, tmp_path, monkeypatch):
    from dflash_pipe.data import load_prompts
    from dflash_pipe.eval.runner import encode_prompt

    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp_path / "train" / "export")
    prompts = load_prompts("humaneval", 2)
    lens = [len(encode_prompt(llama.tokenizer, p.messages)) for p in prompts]
    assert lens[0] != lens[1]
    short, long_ = sorted(lens)
    monkeypatch.setattr(llama.config, "max_position_embeddings", short + 12 + 4)   # room for the shorter one only
    report = run_eval(_cfg(tmp_path, prompts="humaneval"), bundle=llama)
    s = report["sets"]["humaneval"]
    gone = prompts[lens.index(long_)].id
    assert s["prompts"] == 1 and s["skipped_too_long"] == 1
    assert s["skipped_ids"] == [{"id": gone, "prompt_tokens": long_}]
    md = (tmp_path / "train" / "eval" / "eval_report.md").read_text()
    assert f"longer than {short} tokens" in md and f"{gone} ({long_} tokens)" in md


def test_run_eval_refuses_missing_or_foreign_drafter(llama, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        run_eval(_cfg(tmp_path, drafter=str(tmp_path / "nope")), bundle=llama)
    drafter, dcfg = tiny_drafter(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    export_drafter(drafter, dcfg, tmp_path / "foreign")
    with pytest.raises(ValidationError, match="hidden_size: drafter 32 vs target 64"):
        run_eval(_cfg(tmp_path, drafter=str(tmp_path / "foreign")), bundle=llama)


def _untimed(x):
    """The report without wall-clock fields (they differ between any two runs)."""
    timing = ("wall_s", "draft_s", "verify_s", "prefill_s", "other_s", "tokens_per_s", "speedup")
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in timing}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def test_interrupted_eval_resumes_to_the_uninterrupted_report(llama, tmp_path, monkeypatch):
    import dflash_pipe.eval.runner as runner
    from dflash_pipe.eval.progress_log import PROGRESS_FILE

    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp_path / "train" / "export")
    full = run_eval(_cfg(tmp_path, output_dir=str(tmp_path / "full"), mtbench_turns=2), bundle=llama)
    part_cfg = _cfg(tmp_path, output_dir=str(tmp_path / "part"), mtbench_turns=2)
    real, calls = runner.greedy_generate, {"n": 0}

    def counting(*a, fail_at=None, **k):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KeyboardInterrupt
        return real(*a, **k)

    # call 1 is the warm-up, calls 2-5 the two MT-Bench prompts' two turns each, call 6 the first HumanEval prompt;
    # stopping at call 4 (prompt 82, turn 1) leaves prompt 81's two turns done
    monkeypatch.setattr(runner, "greedy_generate", lambda *a, **k: counting(*a, fail_at=4, **k))
    with pytest.raises(KeyboardInterrupt):
        run_eval(part_cfg, bundle=llama)
    progress = tmp_path / "part" / PROGRESS_FILE
    assert len(progress.read_text().splitlines()) == 2
    calls["n"] = 0
    monkeypatch.setattr(runner, "greedy_generate", counting)
    resumed = run_eval(part_cfg, bundle=llama)
    assert calls["n"] == 1 + 2 + 2  # a warm-up, prompt 82's two turns, the two HumanEval prompts
    assert _untimed(resumed["sets"]) == _untimed(full["sets"])
    assert not progress.exists()  # removed once the report is written
    rows = lambda d: [_untimed(json.loads(ln)) for ln in (d / "eval_prompts.jsonl").read_text().splitlines()]  # noqa: E731
    assert rows(tmp_path / "part") == rows(tmp_path / "full")


def _export_pair(tmp_path):
    """Two exports: 'a' a random tiny drafter, 'b' another one marked (mask token) for the oracle below."""
    da, ca = tiny_drafter(block_size=4, seed=0)
    db, cb = tiny_drafter(block_size=4, seed=1)
    cb.mask_token_id -= 1
    export_drafter(da, ca, tmp_path / "a" / "export")
    export_drafter(db, cb, tmp_path / "b" / "export")
    (tmp_path / "a" / "metrics.jsonl").write_text(json.dumps({"step": 0, "tau": 1.25}) + "\n")
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps({"step": 0, "tau": 3.5}) + "\n")
    return tmp_path / "a" / "export", tmp_path / "b" / "export"


@pytest.mark.slow
def test_several_drafters_share_the_baselines_and_equal_one_drafter_runs(llama, tmp_path, monkeypatch):
    import dflash_pipe.eval.runner as runner
    from dflash_pipe.eval.target_step import greedy_generate

    mark = tiny_drafter()[1].mask_token_id - 1

    class OracleForB(runner.DFlashProposer):
        """Drafter 'b' drafts the target's own greedy continuation (tau near B); 'a' is the real drafter."""

        def propose(self, tokens, features, num):
            if self.cfg.mask_token_id == mark and num > 0:
                return greedy_generate(llama.model, tokens, num, [])
            return super().propose(tokens, features, num)

    monkeypatch.setattr(runner, "DFlashProposer", OracleForB)
    a, b = _export_pair(tmp_path)
    both = run_eval(_cfg(tmp_path, drafter=f"a={a},b={b}", output_dir=str(tmp_path / "both")), bundle=llama)
    alone = {n: run_eval(_cfg(tmp_path, drafter=str(d), output_dir=str(tmp_path / n)), bundle=llama)
             for n, d in (("a", a), ("b", b))}
    for name, s in both["sets"].items():
        assert list(s) == ["prompts", "skipped_too_long", "target_only", "dflash:a", "dflash:b", "ngram",
                           "generations", "skipped_ids"]
        for n in ("a", "b"):
            assert _untimed(s[f"dflash:{n}"]) == _untimed(alone[n]["sets"][name]["dflash"])
            assert _untimed(s["ngram"]) == _untimed(alone[n]["sets"][name]["ngram"])
        assert s["dflash:b"]["tau"] > 2.5 > 1.5 > s["dflash:a"]["tau"]   # the two were not mixed up
        assert s["dflash:a"]["identical_to_target"] == s["dflash:b"]["identical_to_target"] == 1.0
    assert both["training"]["dflash:a"]["tau_last"] == 1.25 and both["training"]["dflash:b"]["tau_last"] == 3.5
    assert list(both["drafters"]) == ["dflash:a", "dflash:b"] and both["drafters"]["dflash:b"]["dir"] == str(b)
    md = (tmp_path / "both" / "eval_report.md").read_text()
    ratio = both["sets"]["mtbench"]["dflash:b"]["tau"] / both["sets"]["mtbench"]["ngram"]["tau"]
    assert f"| mtbench | 2 | DFlash[b] | {both['sets']['mtbench']['dflash:b']['tau']:.2f} | {ratio:.2f}x |" in md
    assert "DFlash[a]: training-time simulated tau: last 1.25" in md
    rows = [json.loads(ln) for ln in (tmp_path / "both" / "eval_prompts.jsonl").read_text().splitlines()]
    assert sorted({r["method"] for r in rows}) == ["dflash:a", "dflash:b", "ngram", "target"]


@pytest.mark.parametrize("spec, error", [("a={a},a={b}", "names 'a' twice"), ("{a},{b}", "is not name=dir"),
                                         ("a b={a}", "is not name=dir"), ("a={a},b=", "is not name=dir"),
                                         ("a={a},b={a}/missing", "does not exist")])
def test_drafter_list_errors_name_the_entry(llama, tmp_path, spec, error):
    a, b = _export_pair(tmp_path)
    with pytest.raises(UsageError, match=error):
        run_eval(_cfg(tmp_path, drafter=spec.format(a=a, b=b)), bundle=llama)


def test_one_drafter_directory_with_an_equals_sign_in_its_path_is_one_drafter(tmp_path):
    """'runs/lr=3e-4/export' was parsed as a name=dir list and refused (session 28's review)."""
    from dflash_pipe.config import RunConfig
    from dflash_pipe.eval.runner import drafter_specs

    d, c = tiny_drafter(block_size=4)
    export_drafter(d, c, tmp_path / "lr=3e-4" / "export")
    cfg = RunConfig()
    cfg.eval.drafter = str(tmp_path / "lr=3e-4" / "export")
    assert [(s.method, s.export) for s in drafter_specs(cfg)] == [("dflash", tmp_path / "lr=3e-4" / "export")]


def test_drafters_of_different_block_sizes_are_refused(llama, tmp_path):
    a, _ = _export_pair(tmp_path)
    d8, c8 = tiny_drafter(block_size=8)
    export_drafter(d8, c8, tmp_path / "b8")
    with pytest.raises(ValidationError, match="block size 8"):
        run_eval(_cfg(tmp_path, drafter=f"a={a},b8={tmp_path / 'b8'}"), bundle=llama)
