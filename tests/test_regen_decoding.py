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
                                      (dict(engine="fast"), "--engine")])
def test_bad_decoding_flags_are_usage_errors_naming_the_flag(cfg, llama, tmp_path, kw, flag):
    with pytest.raises(UsageError, match=flag) as err:
        _run(cfg, llama, tmp_path / "x.jsonl", **kw)
    assert err.value.exit_code == 2
    assert not (tmp_path / "x.jsonl").exists()


def test_out_of_memory_halves_the_batch_and_reruns_the_answers_in_flight(cfg, llama, tmp_path, monkeypatch, capsys):
    sampling = dict(samples=2, temperature=0.9, seed=7)
    _run(cfg, llama, tmp_path / "ref.jsonl", batch_size=4, **sampling)
    real = regen_backends.EngineBackend._decode
    faults = {"n": 0}

    def decode_oom_above_batch_1(self):
        if self.B > 1 and self.decode_steps == 2:          # mid-answer, with rows in flight
            faults["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self)

    monkeypatch.setattr(regen_backends.EngineBackend, "_decode", decode_oom_above_batch_1)
    _run(cfg, llama, tmp_path / "oom.jsonl", batch_size=4, **sampling)
    assert faults["n"] == 2                                   # 4 -> 2 -> 1
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
