"""regenerate on the static-KV engine: equals the HF path, sampling is batch-independent, bad input, OOM halving."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_pipe.errors import UsageError, ValidationError
from dflash_pipe.eval import regen_backends
from dflash_pipe.eval.regen_sampling import Decoding, next_tokens, uniforms
from dflash_pipe.eval.regenerate import run_regenerate, sidecar_path
from tests.eval_helpers import llama  # noqa: F401 - pytest fixture
from tests.test_eval_regenerate import NEW, _rows, cfg  # noqa: F401 - pytest fixture

SAMPLING = dict(samples=2, temperature=0.9, top_p=0.95, seed=7)


def _run(cfg, llama, out, batch_size=2, **kw):
    return run_regenerate(cfg, out, max_new_tokens=NEW, batch_size=batch_size, device="cpu", bundle=llama, **kw)


def test_engine_output_equals_the_hf_generate_path(cfg, llama, tmp_path, capsys):
    _run(cfg, llama, tmp_path / "engine.jsonl", engine="static")
    assert "decode path: static-KV engine (eager, batch 2" in capsys.readouterr().out
    _run(cfg, llama, tmp_path / "hf.jsonl", engine="hf")
    assert "decode path: HF generate" in capsys.readouterr().out
    assert (tmp_path / "engine.jsonl").read_bytes() == (tmp_path / "hf.jsonl").read_bytes()


def test_sampled_answers_do_not_depend_on_the_batch_and_differ_per_sample_and_seed(cfg, llama, tmp_path):
    cfg.data.max_samples = 3
    s1 = _run(cfg, llama, tmp_path / "b1.jsonl", batch_size=1, **SAMPLING)
    _run(cfg, llama, tmp_path / "b3.jsonl", batch_size=3, **SAMPLING)
    assert (tmp_path / "b1.jsonl").read_bytes() == (tmp_path / "b3.jsonl").read_bytes()
    by_id, order = _rows(tmp_path / "b1.jsonl")
    assert order == ["a#0", "a#1", "src:2#0", "src:2#1", "c#0", "c#1"]
    assert by_id["a#0"] != by_id["a#1"]
    assert s1["settings"] | SAMPLING == s1["settings"]            # the decoding settings are pinned
    other = dict(SAMPLING, seed=8)
    _run(cfg, llama, tmp_path / "s8.jsonl", **other)
    assert _rows(tmp_path / "s8.jsonl")[0] != by_id
    with pytest.raises(ValidationError, match="seed: 7 in the file vs 8 now"):
        _run(cfg, llama, tmp_path / "b1.jsonl", **other)
    # --first-sample 1: a second file's sample #1 of each conversation is the same row as the first file's
    more = _run(cfg, llama, tmp_path / "more.jsonl", batch_size=2, **dict(SAMPLING, samples=1), first_sample=1)
    more_by_id, more_order = _rows(tmp_path / "more.jsonl")
    assert more_order == ["a#1", "src:2#1", "c#1"] and more["settings"]["first_sample"] == 1
    assert more_by_id == {k: by_id[k] for k in more_order}
    with pytest.raises(ValidationError, match="first_sample: 1 in the file vs 0 now"):   # the files stay apart
        _run(cfg, llama, tmp_path / "more.jsonl", **dict(SAMPLING, samples=1))


def test_inverse_cdf_sampling_follows_the_distribution_and_the_top_p_cut():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().repeat(20000, 1)
    keys = torch.arange(20000, dtype=torch.long) * 1_000_003
    steps = torch.full((20000,), 3, dtype=torch.long)
    u = uniforms(keys, steps)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    freq = torch.bincount(next_tokens(logits, keys, steps, Decoding(temperature=1.0)), minlength=5) / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    cut = torch.bincount(next_tokens(logits, keys, steps, Decoding(temperature=1.0, top_p=0.8)), minlength=5) / 20000
    assert float(cut[3:].sum()) == 0 and torch.allclose(cut[:3], probs[:3] / 0.9, atol=0.015)
    # a row's token depends on its own (key, step) only: the same row alone gives the same token
    one = next_tokens(logits[5:6], keys[5:6], steps[5:6], Decoding(temperature=1.0))
    assert int(one) == int(next_tokens(logits, keys, steps, Decoding(temperature=1.0))[5])


@pytest.mark.parametrize("kw, flag", [(dict(samples=0), "--samples"), (dict(temperature=-0.5), "--temperature"),
                                      (dict(top_p=0.0, temperature=1.0), "--top-p"),
                                      (dict(top_p=1.5, temperature=1.0), "--top-p"),
                                      (dict(samples=3), "--temperature"), (dict(batch_size=-1), "--batch-size"),
                                      (dict(engine="fast"), "--engine"),
                                      (dict(attention="flash"), "--engine-attention"),
                                      (dict(greedy_after=-1, temperature=1.0), "--greedy-after"),
                                      (dict(greedy_after=4), "--greedy-after 4 .* needs --temperature"),
                                      (dict(first_sample=-1, temperature=1.0), "--first-sample"),
                                      (dict(first_sample=2), "--first-sample 2 .* --temperature 0"),
                                      (dict(attention="rows"), "attention 'rows' needs CUDA"),
                                      (dict(max_turns=-1), "--max-turns")])
def test_bad_decoding_flags_are_usage_errors_naming_the_flag(cfg, llama, tmp_path, kw, flag):
    with pytest.raises(UsageError, match=flag) as err:
        _run(cfg, llama, tmp_path / "x.jsonl", **kw)
    assert err.value.exit_code == 2
    assert not (tmp_path / "x.jsonl").exists()


def test_out_of_memory_halves_the_batch_and_reruns_the_answers_in_flight(cfg, llama, tmp_path, monkeypatch, capsys):
    sampling = dict(samples=2, temperature=0.9, seed=7)
    # The faults below leave every answer to batch 1, so the reference is batch 1 too: a sampled
    # answer is a function of its key, but batch 4 and batch 1 round differently on some CPUs
    # (CI's BLAS did), and a near-tie then samples another token.
    _run(cfg, llama, tmp_path / "ref.jsonl", batch_size=1, attention="sdpa", **sampling)
    real = regen_backends.EngineBackend._decode
    faults = {"n": 0}

    def decode_oom_above_batch_1(self):
        if self.B > 1 and self.decode_steps == 2:          # mid-answer, with rows in flight
            faults["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self)

    built = []
    real_init = regen_backends.EngineBackend.__init__

    def record_attention(self, *a, **kw):
        built.append(kw.get("attention"))
        real_init(self, *a, **kw)

    monkeypatch.setattr(regen_backends.EngineBackend, "_decode", decode_oom_above_batch_1)
    monkeypatch.setattr(regen_backends.EngineBackend, "__init__", record_attention)
    _run(cfg, llama, tmp_path / "oom.jsonl", batch_size=4, attention="sdpa", **sampling)
    assert faults["n"] == 2                                   # 4 -> 2 -> 1
    assert built == ["sdpa"] * 3                              # the smaller engines keep --engine-attention
    log = capsys.readouterr().out
    assert "batch 4; continuing at --batch-size 2" in log and "batch 2; continuing at --batch-size 1" in log
    assert (tmp_path / "oom.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    side = json.loads(sidecar_path(tmp_path / "oom.jsonl").read_text())
    assert side["decode_path"].startswith("static-KV engine (eager, batch 1,")


def test_a_sidecar_from_before_the_decoding_flags_resumes_as_greedy(cfg, llama, tmp_path):
    out = tmp_path / "old.jsonl"
    cfg.data.max_samples = 2
    _run(cfg, llama, out)
    side = json.loads(sidecar_path(out).read_text())
    for k in ("samples", "temperature", "top_p", "seed"):
        del side["settings"][k]
    sidecar_path(out).write_text(json.dumps(side))
    cfg.data.max_samples = 0
    _run(cfg, llama, out)
    _run(cfg, llama, tmp_path / "direct.jsonl")
    assert out.read_bytes() == (tmp_path / "direct.jsonl").read_bytes()
    with pytest.raises(ValidationError, match="temperature"):
        _run(cfg, llama, out, temperature=0.5)


def test_the_output_pins_the_source_by_content_not_by_path(cfg, llama, tmp_path):
    """An edited source at the same path is refused (until session 28 only the path was pinned, so a resume
    appended answers of other conversations); the same content at another path resumes."""
    out = tmp_path / "pinned.jsonl"
    cfg.data.max_samples = 2
    _run(cfg, llama, out)
    src = tmp_path / "src.jsonl"
    original = src.read_bytes()
    src.write_bytes(original.replace(b"{", b'{"id": "edited", ', 1))
    cfg.data.max_samples = 0
    with pytest.raises(ValidationError, match=r"source_files: \[src.jsonl \(\d+ bytes, sha256 [0-9a-f]{12}\)\] in "
                                              r"the file vs \[src.jsonl \(\d+ bytes"):
        _run(cfg, llama, out)
    moved = tmp_path / "moved" / "src.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(original)
    cfg.data.source = str(moved)
    _run(cfg, llama, out)
    src.write_bytes(original)
    cfg.data.source = str(src)
    _run(cfg, llama, tmp_path / "direct.jsonl")
    assert out.read_bytes() == (tmp_path / "direct.jsonl").read_bytes()


def test_hybrid_target_falls_back_to_hf_generate_and_refuses_sampling(cfg, tmp_path, tmp_path_factory, capsys):
    from dflash_pipe.target import load_target

    hybrid = load_target("random:tiny-qwen3.5", dtype="float32",
                         model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache")
    cfg.data.max_samples = 1
    state = _run(cfg, hybrid, tmp_path / "h.jsonl")
    assert "decode path: HF generate (batch 2; model type 'qwen3_5_text'" in capsys.readouterr().out
    assert state["rows_written"] == 1
    with pytest.raises(UsageError, match="sampling needs the static-KV engine"):
        _run(cfg, hybrid, tmp_path / "h2.jsonl", temperature=1.0)
    with pytest.raises(UsageError, match="--engine static"):
        _run(cfg, hybrid, tmp_path / "h3.jsonl", engine="static")
    _run(cfg, hybrid, tmp_path / "h4.jsonl", overlap=True, collect_early=2)   # flags named as ignored, not dropped
    out = capsys.readouterr().out
    assert "--overlap-prefill ignored: it needs the static-KV engine" in out and "--collect-early ignored" in out
    assert (tmp_path / "h4.jsonl").read_bytes() == (tmp_path / "h.jsonl").read_bytes()



def test_engine_backend_refills_slots_and_each_answer_is_the_unbatched_greedy_one(llama):
    """7 prompts through 3 slots, prefill groups of at most 40 tokens: every answer equals plain greedy decoding."""
    from dflash_pipe.eval import eos_token_ids, greedy_generate

    eos = eos_token_ids(llama.model, llama.tokenizer)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 30, 4, 17, 25, 2, 12)]
    be = regen_backends.EngineBackend(llama.model, eos, batch=3, max_len=64, max_new_tokens=10, dec=Decoding(),
                                      check_every=3, prefill_tokens=40)
    ready = [regen_backends.TurnRequest(None, p, key=0, order=i) for i, p in enumerate(prompts)]
    got, rounds = {}, 0
    while ready or be.busy():
        be.launch(ready)
        for c in be.collect():
            got[c.request.order] = c.tokens + [eos[0]] * c.ended
        rounds += 1
    assert rounds > 3 and sorted(got) == list(range(7))
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(llama.model, p, 10, eos), i


def test_decode_steps_called_outside_inference_mode_work(llama):
    """The GPU no-sync test's call sequence on the CPU: launch + collect, then bare `_decode` calls from plain
    (non-inference-mode) code. The buffers made under inference mode used to refuse the in-place update."""
    be = regen_backends.EngineBackend(llama.model, [2], batch=4, max_len=96, max_new_tokens=32,
                                      dec=Decoding(temperature=0.8, top_p=0.9), check_every=4)
    g = torch.Generator().manual_seed(0)
    ready = [regen_backends.TurnRequest(None, torch.randint(3, 49152, (n,), generator=g).tolist(), key=i, order=i)
             for i, n in enumerate((5, 20, 9, 1))]
    be.launch(ready)
    be.collect()
    before = be.n_gen.clone()
    for _ in range(4):
        be._decode()
    assert be.decode_steps == 8
    assert torch.equal(be.n_gen, before + 4 * (before < 32).long())   # every unfinished row took 4 more tokens


def test_batched_prompt_encoding_equals_the_one_by_one_encoding(llama):
    """regenerate tokenizes a round's prompts in one batch; the ids must be encode_prompt's, template or not."""
    from dflash_pipe.eval.runner import encode_prompt, encode_prompts
    from tests.test_eval_regenerate import ROWS

    convs = [r["messages"] for r in ROWS if "messages" in r] + [[{"role": "user", "content": "é ü 你好 \n\n  x"}]]
    convs = [[m for m in c if m["role"] != "assistant" or i] for i, c in enumerate(convs)]
    assert encode_prompts(llama.tokenizer, convs) == [encode_prompt(llama.tokenizer, c) for c in convs]
    assert encode_prompts(llama.tokenizer, []) == []

    class Plain:                          # no chat template: plain text, the tokenizer's own special tokens
        chat_template = None

        def __call__(self, texts, **kw):
            return {"input_ids": [[len(t), 7] for t in texts] if isinstance(texts, list) else [len(texts), 7]}

    assert encode_prompts(Plain(), convs) == [encode_prompt(Plain(), c) for c in convs]


def test_tail_compaction_moves_rows_and_keeps_every_answer_the_unbatched_greedy_one(llama):
    """8 slots fed one prompt a round: in the tail the live rows move down and the steps run on 4, 2, 1 rows;
    every answer still equals plain greedy decoding of its prompt."""
    from dflash_pipe.eval import greedy_generate

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 30, 4, 17, 25, 2, 12, 6, 21, 3)]
    be = regen_backends.EngineBackend(llama.model, [], batch=8, max_len=64, max_new_tokens=12, dec=Decoding(),
                                      check_every=2, compact=True)
    be.min_width = 1
    moved = []
    move = be.engine.move_rows
    be.engine.move_rows = lambda s, d: (moved.extend(s), move(s, d))[1]
    incoming = [regen_backends.TurnRequest(None, p, key=0, order=i) for i, p in enumerate(prompts)]
    ready, got, widths = [], {}, []
    while incoming or ready or be.busy():
        if incoming:
            ready.append(incoming.pop(0))               # one new prompt a round: staggered finishing times
        be.launch(ready)
        widths.append(be.width)
        for c in be.collect():
            got[c.request.order] = c.tokens
    assert sorted(got) == list(range(len(prompts)))
    assert moved and min(widths) == 1 and max(widths) == 8, (moved, widths)
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(llama.model, p, 12, []), i
    assert be.stats()["mean_decode_width"] < 8


def test_refills_that_wait_and_take_prompts_out_of_order_give_the_same_answers(llama):
    """A refill threshold of 3 free slots and a lookahead that picks by length bucket admit the prompts in another
    order than the ready list's, in no more prefill calls; every answer is still the one of the plain policy."""
    from dflash_pipe.eval.regen_refill import RefillPolicy

    g = torch.Generator().manual_seed(8)
    lens = (40, 3, 5, 70, 2, 66, 4, 38, 6, 1, 35, 7)
    runs = {}
    for name, pol in (("plain", RefillPolicy(min_free=1, lookahead=1, budget=4096)),
                      ("waiting", RefillPolicy(min_free=3, lookahead=12, budget=4096))):
        g.manual_seed(8)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]
        be = regen_backends.EngineBackend(llama.model, [2], batch=4, max_len=128, max_new_tokens=9,
                                          dec=Decoding(temperature=0.9, seed=3), check_every=2)
        be.policy = pol
        ready = [regen_backends.TurnRequest(None, p, key=i, order=i) for i, p in enumerate(prompts)]
        admitted, got = [], {}
        while ready or be.busy():
            before = {id(r) for r in ready}
            be.launch(ready)
            admitted += [s.order for s in be.slots if s is not None and id(s) in before]
            for c in be.collect():
                got[c.request.order] = c.tokens
        runs[name] = (got, admitted, be.prefill_calls)
    assert runs["waiting"][0] == runs["plain"][0] and sorted(runs["plain"][0]) == list(range(len(lens)))
    assert runs["plain"][1] == sorted(runs["plain"][1]) and runs["waiting"][1] != sorted(runs["waiting"][1])
    assert runs["waiting"][2] <= runs["plain"][2]


def test_refills_rounded_to_a_row_bucket_give_the_same_answers(llama, monkeypatch):
    """round_rows (CUDA's default) leaves some free slots for the next refill; the answers are the plain policy's.
    A quarter of the vocabulary ends an answer, so answers end at different steps and refills vary in size."""
    from dflash_pipe.eval.regen_refill import RefillPolicy, plan_refill

    short = []

    def counting(free, window, waiting, live, p):
        plan = plan_refill(free, window, waiting, live, p)
        short.append(bool(plan) and sum(map(len, plan)) < min(free, waiting))
        return plan

    monkeypatch.setattr(regen_backends, "plan_refill", counting)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in [9, 3, 30, 5, 2, 17, 4, 8, 6, 1, 12] * 3]
    runs = {}
    for name, rounded in (("plain", False), ("rounded", True)):
        short.clear()
        be = regen_backends.EngineBackend(llama.model, list(range(2, 49152, 4)), batch=8, max_len=96,
                                          max_new_tokens=20, dec=Decoding(temperature=0.9, seed=4), check_every=1)
        be.policy = RefillPolicy(min_free=5, lookahead=8, budget=4096, min_rows=1, round_rows=rounded)
        ready = [regen_backends.TurnRequest(None, p, key=i, order=i) for i, p in enumerate(prompts)]
        got = {}
        while ready or be.busy():
            be.launch(ready)
            for c in be.collect():
                got[c.request.order] = c.tokens
        runs[name] = (got, any(short))
    assert runs["rounded"][1] and not runs["plain"][1]  # the rounding did leave slots free at some refill
    assert runs["rounded"][0] == runs["plain"][0] and sorted(runs["plain"][0]) == list(range(len(prompts)))


def test_greedy_after_samples_the_first_tokens_then_continues_with_the_greedy_choices(llama, monkeypatch):
    """--greedy-after K: tokens 0..K-1 are the plain sampled ones (same key, same draw), every later token is the
    greedy continuation of the prompt plus the answer so far (checked against unbatched greedy decoding). Steps
    where no row is within its first K tokens take the argmax alone (no softmax / sort): some steps must."""
    from dflash_pipe.eval import eos_token_ids, greedy_generate

    modes = []
    real = regen_backends.next_tokens
    monkeypatch.setattr(regen_backends, "next_tokens",
                        lambda logits, keys, steps, dec: modes.append(dec.greedy) or real(logits, keys, steps, dec))

    eos = eos_token_ids(llama.model, llama.tokenizer)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 19, 3, 11)]

    def answers(dec):
        be = regen_backends.EngineBackend(llama.model, eos, batch=2, max_len=64, max_new_tokens=12, dec=dec,
                                          check_every=3)
        ready = [regen_backends.TurnRequest(None, p, key=1000 + i, order=i) for i, p in enumerate(prompts)]
        got = {}
        while ready or be.busy():
            be.launch(ready)
            for c in be.collect():
                got[c.request.order] = c.tokens + [eos[0]] * c.ended
        return [got[i] for i in range(len(prompts))]

    K = 3
    sampled = answers(Decoding(temperature=1.5))
    modes.clear()
    mixed = answers(Decoding(temperature=1.5, greedy_after=K))
    assert True in modes and False in modes                            # argmax-only steps and sampling steps
    greedy = [greedy_generate(llama.model, p, 12, eos) for p in prompts]
    for p, s, m, gr in zip(prompts, sampled, mixed, greedy):
        assert m[:K] == s[:K]                                         # the same draws for the first K tokens
        if any(t in eos for t in m[:K]):
            continue
        assert m[K:] == greedy_generate(llama.model, p + m[:K], 12 - K, eos)
    assert mixed != greedy and sampled != mixed                        # it did sample, and it did stop sampling
    assert Decoding(temperature=1.0, greedy_after=K).settings()["greedy_after"] == K
    assert "greedy_after" not in Decoding(temperature=1.0).settings()  # old sidecars resume unchanged


def test_samples_equal_to_an_earlier_sample_are_counted_as_duplicates(cfg, llama, tmp_path):
    """--samples N at a temperature so low that every sample is the greedy answer: N - 1 duplicates per
    conversation, their tokens counted, every row still written (the held-out head is counted in rows)."""
    cfg.data.max_samples = 3
    state = _run(cfg, llama, tmp_path / "d.jsonl", samples=3, temperature=1e-4, seed=1)
    by_id, order = _rows(tmp_path / "d.jsonl")
    assert len(order) == 9 and state["duplicate_rows"] == 6
    per_row = state["generated_tokens"] / 9
    assert state["duplicate_tokens"] == pytest.approx(6 * per_row, rel=0.5)
    assert by_id["a#0"] == by_id["a#1"] == by_id["a#2"]
    plain = _run(cfg, llama, tmp_path / "s.jsonl", **SAMPLING)
    assert plain.get("duplicate_rows", 0) == 0                         # distinct samples: nothing counted


@pytest.mark.parametrize("nth", [1, 2])
def test_out_of_memory_inside_a_prefill_reruns_each_request_once(cfg, llama, tmp_path, monkeypatch, nth):
    """A refill places its requests in slots before it prefills them and trims `ready` after: an OOM in its 1st or
    2nd prefill call must not queue the placed ones twice (they were answered twice and the turns repeated)."""
    _run(cfg, llama, tmp_path / "ref.jsonl", batch_size=1, attention="sdpa")
    real = regen_backends.EngineBackend._prefill
    calls = {"n": 0, "faults": 0}

    def prefill_oom_at_batch_4(self, rows, reqs, *a, **kw):
        if self.B == 4:
            calls["n"] += 1
            if calls["n"] == nth:
                calls["faults"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, rows, reqs, *a, **kw)

    monkeypatch.setattr(regen_backends.EngineBackend, "_prefill", prefill_oom_at_batch_4)
    _run(cfg, llama, tmp_path / "oom.jsonl", batch_size=4, attention="sdpa")
    assert calls["faults"] == 1
    assert (tmp_path / "oom.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()


# raises on a system turn (as Gemma's template does) and on one user text (a later turn of conversation "a")
RAISING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                    "supported') }}{% endif %}{% if m['content'] == 'Tell me more.' %}{{ raise_exception('no more') }}"
                    "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_prompt_the_chat_template_raises_on_is_counted_and_skipped_not_fatal(cfg, llama, tmp_path, monkeypatch,
                                                                               prefetch):
    from tests.test_eval_regenerate import ROWS

    monkeypatch.setattr(llama.tokenizer, "chat_template", RAISING_TEMPLATE)
    state = _run(cfg, llama, tmp_path / "all.jsonl", prefetch_prompts=prefetch)
    assert state["template_errors"] == 2
    assert "System role not supported" in state["skipped"]["src:2"] and "first prompt" in state["skipped"]["src:2"]
    # the reference: the same data without the system conversation, and "a" cut before its failing turn
    kept = [r for r in ROWS if r.get("id", "src:2") != "src:2"]
    kept[0] = dict(kept[0], conversations=kept[0]["conversations"][:2])
    (tmp_path / "kept.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    cfg.data.source = str(tmp_path / "kept.jsonl")
    _run(cfg, llama, tmp_path / "ref.jsonl", prefetch_prompts=prefetch)
    assert (tmp_path / "all.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()


def test_a_prompt_longer_than_the_models_context_is_counted_and_skipped(cfg, llama, tmp_path, monkeypatch, capsys):
    """[extract] max_length above the target's context: the context is the limit (a prompt past it is skipped and
    counted, its reason naming the context), not max_length."""
    from dflash_pipe.eval.runner import encode_prompt
    from tests.test_eval_regenerate import ROWS

    first = {r["id"]: encode_prompt(llama.tokenizer, r["messages"][:1]) for r in ROWS
             if r.get("id") in ("e", "f")}
    context = (len(first["e"]) + len(first["f"])) // 2 + NEW    # e's first prompt fits, f's does not (or the reverse)
    longer, shorter = ("e", "f") if len(first["e"]) > len(first["f"]) else ("f", "e")
    assert len(first[longer]) + NEW > context >= len(first[shorter]) + NEW
    monkeypatch.setattr(llama.config, "max_position_embeddings", context)
    cfg.extract.max_length = 4 * context
    state = _run(cfg, llama, tmp_path / "o.jsonl", max_turns=1)
    assert f"exceeds the model's context of {context} tokens" in state["skipped"][longer]
    assert shorter not in state["skipped"] and state["prompts_too_long"] >= 1
    assert f"the target's context is {context} tokens, under [extract] max_length {4 * context}" in \
        capsys.readouterr().out
