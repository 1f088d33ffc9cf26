"""Batched target-only references (eval/reference_batch.py) against batch-1 decoding, in the eval and alone (CPU).

References: `engine_greedy_generate` on the batch-1 engine and the HF-cache `greedy_generate` (itself tested
against transformers' `generate`), and a whole `--reference sequential` eval of the same prompts.
"""

from __future__ import annotations

import json

import pytest

import dflash_pipe.eval.reference_batch as reference_batch
import dflash_pipe.eval.runner as runner
from dflash_pipe.drafter import export_drafter
from dflash_pipe.errors import UsageError
from dflash_pipe.eval import eos_token_ids, greedy_generate
from dflash_pipe.eval.engine_step import EngineTarget, engine_greedy_generate
from dflash_pipe.eval.progress_log import PROGRESS_FILE
from dflash_pipe.eval.reference_batch import ReferenceBatcher, resolve_reference
from dflash_pipe.eval.runner import encode_prompt, run_eval
from tests.eval_helpers import PROMPTS, llama, tiny_drafter  # noqa: F401 - llama is a fixture
from tests.test_eval_runner import _cfg

NEW = 16
TIMING = ("wall_s", "draft_s", "verify_s", "prefill_s", "other_s", "tokens_per_s", "speedup", "sample_tokens_per_s",
          "reference_pass_s")


def _untimed(x):
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def _prompts(bundle) -> list[list[int]]:
    extra = [[{"role": "user", "content": f"Count to {n} in words, then say why."}] for n in range(3, 7)]
    return [encode_prompt(bundle.tokenizer, m) for m in PROMPTS + extra]


def test_batched_references_equal_batch1_greedy_token_for_token_with_eos(llama):
    prompts = _prompts(llama)
    eos = eos_token_ids(llama.model, llama.tokenizer)
    target = EngineTarget(llama.model, (), max_len=256, limit=4096)
    plain = [engine_greedy_generate(target, p, NEW, eos) for p in prompts]
    assert plain[:3] == [greedy_generate(llama.model, p, NEW, eos) for p in prompts[:3]]
    assert len({tuple(r) for r in plain}) == len(prompts)                   # the outputs depend on the prompt
    # EOS cases: stop tokens that end some outputs early (a different one each), at the first and the last token
    stops = [plain[0][5], plain[1][NEW - 1], plain[2][0]]
    cases = [(NEW, eos), (NEW, stops), (1, eos), (2, [plain[3][1]])]
    batcher = ReferenceBatcher(llama.model, eos, NEW, limit=4096, batch=3)   # 7 prompts on 3 slots: refills
    for new, stop in cases:
        batcher.eos, batcher.max_new = stop, new
        batcher.close()
        want = plain if (new, stop) == (NEW, eos) else [engine_greedy_generate(target, p, new, stop) for p in prompts]
        got = batcher.generate(prompts)
        assert got == want, (new, stop)
        if stop is stops:                                                     # EOS kept, as the eval keeps it
            assert all(w[-1] in stops for w in want[:3]) and len(want[0]) <= 6 and want[2] == [stops[2]]
            assert any(len(w) == NEW and w[-1] not in stops for w in want)      # and outputs that ran to the end
    auto = ReferenceBatcher(llama.model, eos, NEW, limit=4096)               # auto batch (16 on the CPU)
    assert auto.generate(prompts[::-1]) == plain[::-1] and auto.backend.B == 8
    assert auto.generate([]) == []
    with pytest.raises(UsageError, match="needs"):
        ReferenceBatcher(llama.model, eos, NEW, limit=20).generate([list(range(3, 14))])


def test_reference_mode_resolution_and_errors(llama, tmp_path):
    import torch

    from dflash_pipe.target import load_target

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_reference("auto", llama.model, "static", cuda) == "batched"
    assert resolve_reference("auto", llama.model, "static", cpu) == "sequential"   # the CPU default stays as it was
    assert resolve_reference("auto", llama.model, "hf", cuda) == "sequential"
    assert resolve_reference("batched", llama.model, "hf", cpu) == "batched"
    half = load_target("random:tiny-llama", dtype="bfloat16", with_tokenizer=False)
    assert resolve_reference("auto", half.model, "static", cuda) == "sequential"   # bf16: only when asked for
    assert resolve_reference("batched", half.model, "static", cuda) == "batched"
    qwen = load_target("random:tiny-qwen3.5", dtype="float32", with_tokenizer=False)
    with pytest.raises(UsageError, match="--reference batched"):
        resolve_reference("batched", qwen.model, "hf", cuda)
    with pytest.raises(UsageError, match="--reference must be one of"):
        resolve_reference("fast", llama.model, "hf", cpu)
    with pytest.raises(UsageError, match="--baseline-every must be >= 1"):
        run_eval(_cfg(tmp_path, baseline_every=0), bundle=llama)


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory):
    """A sequential and a batched eval of the same prompts (2 MT-Bench prompts x 2 turns + 2 HumanEval), with an extra
    EOS token that ends some references early; the batched one times every 2nd generation at batch 1."""
    tmp = tmp_path_factory.mktemp("evalref")
    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp / "train" / "export")
    eos = eos_token_ids(llama.model, llama.tokenizer)
    from dflash_pipe.data import load_prompts

    first = encode_prompt(llama.tokenizer, load_prompts("humaneval", 1)[0].messages)
    stop = greedy_generate(llama.model, first, 12, eos)[6]
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "eos_token_ids", lambda m, t: eos + [stop])
    kw = dict(mtbench_turns=2, engine="static")
    out = {mode: run_eval(_cfg(tmp, reference=mode, baseline_every=2, output_dir=str(tmp / mode), **kw), bundle=llama)
           for mode in ("sequential", "batched")}
    yield tmp, out, kw, mp
    mp.undo()


def _rows(d):
    return [json.loads(ln) for ln in (d / "eval_prompts.jsonl").read_text().splitlines()]


def test_batched_eval_equals_the_sequential_eval(runs):
    tmp, out, _, _ = runs
    seq, bat = out["sequential"], out["batched"]
    assert seq["reference"] == "sequential" and bat["reference"] == "batched"
    for name, s in seq["sets"].items():
        b = bat["sets"][name]
        for m in ("dflash", "ngram"):                 # same outputs, steps and acceptance; identical to the references
            assert _untimed(b[m]) == _untimed(s[m]) and b[m]["identical_to_target"] == 1.0
            assert b[m]["speedup"] is not None
        t = b["target_only"]
        assert t["generated_tokens"] == s["target_only"]["generated_tokens"]
        assert t["timed_generations"] == (b["generations"] + 1) // 2 and t["batch1_mismatches"] == 0
        assert t["wall_s"] > 0 and t["tokens_per_s"] > 0 and t["reference_pass_s"] > 0
        assert "reference" not in s["target_only"]
    srows, brows = _rows(tmp / "sequential"), _rows(tmp / "batched")
    targets = [r for r in brows if r["method"] == "target"]
    assert [r["generated"] for r in targets] == [r["generated"] for r in srows if r["method"] == "target"]
    assert min(r["generated"] for r in targets) < 12 == max(r["generated"] for r in targets)   # EOS cases, and not
    for rows in (targets[:4], targets[4:]):           # mtbench (4 generations), humaneval (2): every 2nd one timed
        assert [r["timed"] for r in rows] == [i % 2 == 0 for i in range(len(rows))]
        assert all((r["wall_s"] is not None) == r["timed"] for r in rows)
        assert [r["batch1_identical"] for r in rows] == [True if r["timed"] else None for r in rows]
    spec = lambda rows: [_untimed(r) for r in rows if r["method"] != "target"]  # noqa: E731
    assert spec(brows) == spec(srows)
    md = (tmp / "batched" / "eval_report.md").read_text()
    assert "generated batched" in md and "mtbench: 2 of 4 generations timed at batch 1 (one in 2)" in md
    assert "equal to the batched reference in 2 of 2" in md
    assert "generated batched" not in (tmp / "sequential" / "eval_report.md").read_text()


def test_a_perturbed_batched_reference_is_detected(llama, runs, monkeypatch):
    tmp, out, kw, _ = runs
    real = ReferenceBatcher.generate

    def perturbed(self, prompts):
        refs = real(self, prompts)
        if refs:
            refs[0] = refs[0][:-1] + [(refs[0][-1] + 1) % 49152]          # the first generation of every wave
        return refs

    monkeypatch.setattr(ReferenceBatcher, "generate", perturbed)
    rep = run_eval(_cfg(tmp, reference="batched", baseline_every=2, output_dir=str(tmp / "perturbed"), **kw),
                   bundle=llama)
    s = rep["sets"]["humaneval"]                      # one wave: generation 0 (timed) perturbed, generation 1 not
    assert s["target_only"]["batch1_mismatches"] == 1 and s["target_only"]["timed_generations"] == 1
    assert s["dflash"]["identical_to_target"] == s["ngram"]["identical_to_target"] == 0.5
    m = rep["sets"]["mtbench"]                        # two waves: generations 0 (turn 1, timed) and 1 (turn 2, untimed)
    assert m["target_only"]["batch1_mismatches"] == 1 and m["dflash"]["identical_to_target"] < 1
    md = (tmp / "perturbed" / "eval_report.md").read_text()
    assert "equal to the batched reference in 0 of 1" in md and "Not every output is identical" in md


def test_interrupted_batched_eval_resumes_without_redoing_generations(llama, runs, monkeypatch):
    tmp, out, kw, _ = runs
    real_methods, real_gen = reference_batch.run_methods, ReferenceBatcher.generate
    calls = {"methods": 0, "refs": 0, "fail_at": 4}

    def methods(*a, **k):
        calls["methods"] += 1
        if calls["methods"] == calls["fail_at"]:
            raise KeyboardInterrupt
        return real_methods(*a, **k)

    def gen(self, prompts):
        calls["refs"] += len(prompts)
        return real_gen(self, prompts)

    monkeypatch.setattr(reference_batch, "run_methods", methods)
    monkeypatch.setattr(ReferenceBatcher, "generate", gen)
    cfg = _cfg(tmp, reference="batched", baseline_every=2, output_dir=str(tmp / "part"), **kw)
    with pytest.raises(KeyboardInterrupt):               # at MT-Bench generation 3 (prompt 82, turn 2)
        run_eval(cfg, bundle=llama)
    progress = tmp / "part" / PROGRESS_FILE
    assert len(progress.read_text().splitlines()) == 3 and calls["refs"] == 4
    calls.update(methods=0, refs=0, fail_at=0)
    resumed = run_eval(cfg, bundle=llama)
    assert calls["methods"] == 1 + 2                      # MT-Bench's last generation, the two HumanEval ones
    assert calls["refs"] == 1 + 2                         # references only for those: the others come from the file
    assert _untimed(resumed["sets"]) == _untimed(out["batched"]["sets"])
    assert [_untimed(r) for r in _rows(tmp / "part")] == [_untimed(r) for r in _rows(tmp / "batched")]
    assert not progress.exists()


@pytest.mark.slow
def test_out_of_memory_in_the_reference_pass_halves_the_batch(llama, monkeypatch):
    import torch

    from dflash_pipe.errors import RuntimeFailure

    prompts = _prompts(llama)
    eos = eos_token_ids(llama.model, llama.tokenizer)
    want = ReferenceBatcher(llama.model, eos, 6, limit=4096, batch=4).generate(prompts)
    real = reference_batch.EngineBackend
    seen = {"built": [], "launch_fail": 1}

    class Flaky(real):
        def __init__(self, model, eos, batch, *a, **k):
            seen["built"].append(batch)
            if batch > 2:                                  # "too big" at engine build
                raise torch.OutOfMemoryError("injected")
            super().__init__(model, eos, batch, *a, **k)

        def launch(self, ready):
            if seen["launch_fail"] and self.decode_steps > 0:   # once, mid-pass, after some answers were decoded
                seen["launch_fail"] -= 1
                raise torch.OutOfMemoryError("injected")
            super().launch(ready)

    monkeypatch.setattr(reference_batch, "EngineBackend", Flaky)
    b = ReferenceBatcher(llama.model, eos, 6, limit=4096, batch=4)
    assert b.generate(prompts) == want
    assert seen["built"] == [4, 2, 1] and seen["launch_fail"] == 0 and b.batch == 1   # 4 fails, 2 fails mid-pass, 1
    monkeypatch.setattr(Flaky, "launch", lambda self, ready: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    with pytest.raises(RuntimeFailure, match="--reference sequential"):
        ReferenceBatcher(llama.model, eos, 6, limit=4096, batch=2).generate(prompts)


class _GreedyOracle:
    """Stands in for prompt lookup: drafts the target's greedy continuation with one slot made wrong (which one
    depends on the anchor), so drafts are accepted in part and the acceptance is not trivially 0."""

    needs_features = False

    def __init__(self, model):
        self.model = model

    def propose(self, tokens, features, num):
        drafts = greedy_generate(self.model, tokens, num, [])[:num]
        j = len(tokens) % (num + 1)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % 49152
        return drafts


def test_replay_eval_gives_the_decoded_tau_and_acceptance_on_every_generation(llama, runs, monkeypatch):
    """--replay: generations outside the timed sample are replayed, not decoded; tau, steps and per-position
    acceptance equal the sequential (fully decoded) eval's, per set and per generation; identity and speed-up come
    from the decoded sample, whose replay agrees with its decoding."""
    tmp, _, kw, _ = runs
    monkeypatch.setattr(runner, "NgramProposer", lambda: _GreedyOracle(llama.model))
    seq = run_eval(_cfg(tmp, reference="sequential", output_dir=str(tmp / "oracle-seq"), **kw), bundle=llama)
    rep = run_eval(_cfg(tmp, reference="batched", baseline_every=2, replay=True, teacher_forced_every=1,
                        output_dir=str(tmp / "replay"), **kw), bundle=llama)
    assert all(1.5 < s["ngram"]["tau"] < 4 for s in seq["sets"].values())    # accepted in part
    keys = ("tau", "acceptance", "accepted_per_slot", "eligible_per_slot", "steps", "generated_tokens")
    for name, s in seq["sets"].items():
        r = rep["sets"][name]
        timed = r["target_only"]["timed_generations"]
        for m in ("dflash", "ngram"):
            assert {k: r[m][k] for k in keys} == {k: s[m][k] for k in keys}, (name, m)
            assert r[m]["replayed"] == r["generations"] - timed and r[m]["replay_checked"] == timed
            assert r[m]["replay_agreed"] == timed and r[m]["identical_to_target"] == 1.0
            assert r[m]["speedup"] is not None
            # --teacher-forced-every 1: a block at every reference token but the last, decoded sample included
            tf = r[m]["teacher_forced"]
            assert tf["blocks"] == r[m]["generated_tokens"] - r["generations"]
            assert 1 <= tf["tau_walk"] <= tf["tau"] <= 16
    assert "Teacher-forced on the references" in (tmp / "replay" / "eval_report.md").read_text()
    by = lambda rows: {(x["id"], x["method"]): (x.get("tau"), x.get("steps"), x.get("accepted"))  # noqa: E731
                       for x in rows if x["method"] != "target"}
    assert by(_rows(tmp / "replay")) == by(_rows(tmp / "oracle-seq"))
    # each generation's record keeps its blocks' matched drafts; with --teacher-forced-every 1, one per reference
    # token but the last, and the methods' lists pair block by block
    scanned = [x for x in _rows(tmp / "replay") if x["method"] != "target"]
    assert scanned and all(len(x["scan_matched"]) == x["generated"] - 1 for x in scanned)
    assert all(0 <= k <= 15 for x in scanned for k in x["scan_matched"])
    with pytest.raises(UsageError, match="--replay"):
        run_eval(_cfg(tmp, reference="sequential", replay=True, output_dir=str(tmp / "bad"), **kw), bundle=llama)
    with pytest.raises(UsageError, match="add --replay"):
        run_eval(_cfg(tmp, reference="batched", teacher_forced_every=2, output_dir=str(tmp / "bad"), **kw), bundle=llama)
    with pytest.raises(UsageError, match="teacher-forced-every must be in"):
        run_eval(_cfg(tmp, reference="batched", replay=True, teacher_forced_every=99, output_dir=str(tmp / "bad"),
                      **kw), bundle=llama)
    with pytest.raises(UsageError, match="must be in 0..4 ") as err:   # out of range first: not told to add --replay
        run_eval(_cfg(tmp, reference="batched", teacher_forced_every=99, output_dir=str(tmp / "bad"), **kw), bundle=llama)
    assert not err.value.hint
    with pytest.raises(UsageError, match="teacher-forced-every must be >= 0"):   # before the target loads
        run_eval(_cfg(tmp, reference="batched", teacher_forced_every=-1, output_dir=str(tmp / "bad"), **kw), bundle=None)


def test_a_replay_that_disagrees_with_decoding_is_counted(llama, runs, monkeypatch):
    """Fault injected: the replay of every generation commits one token less in its first step. The decoded sample's
    check counts every disagreement (replay_agreed 0 of replay_checked), and the report says how many."""
    tmp, _, kw, _ = runs
    real = reference_batch.replay_methods

    def off_by_one(*a, **k):
        out = real(*a, **k)
        for r in out.values():
            r.committed[0] += 1
        return out

    monkeypatch.setattr(reference_batch, "replay_methods", off_by_one)
    rep = run_eval(_cfg(tmp, reference="batched", baseline_every=2, replay=True, output_dir=str(tmp / "replay-bad"),
                        **kw), bundle=llama)
    for s in rep["sets"].values():
        for m in ("dflash", "ngram"):
            assert s[m]["replay_checked"] == s["target_only"]["timed_generations"] > 0
            assert s[m]["replay_agreed"] == 0
    md = (tmp / "replay-bad" / "eval_report.md").read_text()
    assert "timed ones' replays equal to their decoding in 0 of 4" in md      # mtbench: 2 timed x 2 methods
