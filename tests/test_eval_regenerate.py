"""`run_regenerate`: turn-by-turn greedy answers, resumable after a kill, readable by the data reader."""

from __future__ import annotations

import json

import pytest

from dflash_pipe.config import RunConfig
from dflash_pipe.data import iter_conversations
from dflash_pipe.errors import UsageError, ValidationError
from dflash_pipe.eval import eos_token_ids, greedy_generate
from dflash_pipe.eval import regenerate as regen_mod
from dflash_pipe.eval.regenerate import run_regenerate, sidecar_path
from dflash_pipe.eval.runner import encode_prompt
from tests.eval_helpers import llama  # noqa: F401 - pytest fixture

NEW = 6
ROWS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                  {"from": "human", "value": "Tell me more."}, {"from": "gpt", "value": "Sure"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"id": "c", "messages": [{"role": "assistant", "content": "lead"}, {"role": "user", "content": "x"},
                             {"role": "assistant", "content": "y"}, {"role": "user", "content": "trailing"}]},
    {"text": "a plain document is not a conversation"},
    {"id": "e", "messages": [{"role": "user", "content": "Why is the sky blue?"},
                             {"role": "assistant", "content": "Rayleigh."}]},
    {"id": "f", "messages": [{"role": "user", "content": "List colours."}, {"role": "assistant", "content": "red"},
                             {"role": "user", "content": "And shapes?"}, {"role": "assistant", "content": "square"},
                             {"role": "user", "content": "Numbers?"}, {"role": "assistant", "content": "one"}]},
    {"id": "g", "messages": [{"role": "user", "content": "Last one."}, {"role": "assistant", "content": "ok"}]},
]


@pytest.fixture()
def cfg(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    c = RunConfig()
    c.data.source = str(src)
    return c


def _source_messages() -> dict[str, list[dict]]:
    """The chat rows of ROWS by sample id, in the reader's normalised form."""
    out = {}
    for r in ROWS:
        if "text" in r:
            continue
        msgs = r.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[m["from"]],
                                      "content": m["value"]} for m in r["conversations"]]
        out[r.get("id", "src:2")] = msgs
    return out


def _rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: r["messages"] for r in rows}, [r["id"] for r in rows]


def _regen(cfg, llama, out, **kw):
    return run_regenerate(cfg, out, max_new_tokens=NEW, batch_size=2, device="cpu", bundle=llama, **kw)


@pytest.fixture()
def reference(cfg, llama, tmp_path):
    out = tmp_path / "ref.jsonl"
    _regen(cfg, llama, out)
    return _rows(out)


def test_turn_by_turn_answers_are_the_targets_own_greedy_responses(reference, llama):
    by_id, order = reference
    assert order == ["a", "src:2", "c", "e", "f", "g"]            # input order; the text row is skipped
    eos = eos_token_ids(llama.model, llama.tokenizer)
    src = _source_messages()
    for sid, messages in by_id.items():
        orig = src[sid]
        # leading assistant turns and trailing user turns are dropped; others keep their role order
        kept = orig[1:] if orig[0]["role"] == "assistant" else orig
        while kept[-1]["role"] != "assistant":
            kept = kept[:-1]
        assert [m["role"] for m in messages] == [m["role"] for m in kept]
        for i, (m, o) in enumerate(zip(messages, kept)):
            if m["role"] != "assistant":
                assert m == o                                       # prompts verbatim
                continue
            # unbatched, unpadded greedy decoding of the regenerated conversation so far
            ids = encode_prompt(llama.tokenizer, messages[:i])
            toks = greedy_generate(llama.model, ids, NEW, eos)
            toks = [t for t in toks if t not in eos]
            assert m["content"] == llama.tokenizer.decode(toks, skip_special_tokens=True)
            assert m["content"] != o["content"]


def test_output_is_readable_by_the_data_reader(reference, tmp_path, cfg, llama):
    out = tmp_path / "ref.jsonl"
    convs = list(iter_conversations(str(out)))
    by_id, order = reference
    assert [c.sample_id for c in convs] == order
    assert all(c.messages == by_id[c.sample_id] for c in convs)


def test_rerun_after_a_line_cut_mid_way_gives_every_id_once_and_identical_content(reference, cfg, llama, tmp_path):
    out = tmp_path / "ref.jsonl"
    full = out.read_bytes()
    lines = full.split(b"\n")
    cut = len(lines[0]) + 1 + len(lines[1]) + 1 + len(lines[2]) // 2      # in the middle of the third row
    out.write_bytes(full[:cut])
    state = _regen(cfg, llama, out)
    assert out.read_bytes() == full
    by_id, order = _rows(out)
    assert sorted(order) == sorted(set(order)) and (by_id, order) == reference
    assert state["rows_written"] == len(order)


def test_crash_inside_a_batch_write_then_resume(reference, cfg, llama, tmp_path, monkeypatch):
    out = tmp_path / "crashed.jsonl"
    real_append = regen_mod.JsonlAppender.append
    calls = {"n": 0}

    def dying_append(self, rows):
        calls["n"] += 1
        if calls["n"] == 2:                       # second batch: half its bytes reach the disk, then death
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
            with open(self.path, "ab") as f:
                f.write(data[:len(data) // 2 + 3])
            raise KeyboardInterrupt
        return real_append(self, rows)

    monkeypatch.setattr(regen_mod.JsonlAppender, "append", dying_append)
    with pytest.raises(KeyboardInterrupt):
        _regen(cfg, llama, out)
    assert not out.read_bytes().endswith(b"\n")
    timing = json.loads(sidecar_path(out).read_text())["timing"]      # the split up to the first flush stays
    assert timing["wall_s"] > 0 and timing["decode_steps"] > 0
    monkeypatch.setattr(regen_mod.JsonlAppender, "append", real_append)
    _regen(cfg, llama, out)
    assert _rows(out) == reference
    # a third run has nothing left to do and changes nothing
    before = out.read_bytes()
    _regen(cfg, llama, out)
    assert out.read_bytes() == before


def test_crash_between_a_flushs_rows_and_its_sidecar_is_counted_as_rows_uncounted(reference, cfg, llama, tmp_path,
                                                                                   monkeypatch):
    """The rows reach the file, the sidecar update after them does not: the resume keeps the rows (the output is the
    truth), and says how many rows the counters (tokens, truncations) leave out instead of silently undercounting."""
    out = tmp_path / "o.jsonl"
    clean = _regen(cfg, llama, tmp_path / "clean.jsonl")
    real_write, real_append = regen_mod.atomic_write_json, regen_mod.JsonlAppender.append
    seen = {"rows": 0, "appends": 0}

    def append(self, rows):
        seen["appends"] += 1
        seen["rows"] = len(rows)
        return real_append(self, rows)

    def write(path, obj):
        if seen["appends"] == 2:                  # the second flush's sidecar update: death before it
            raise KeyboardInterrupt
        return real_write(path, obj)

    monkeypatch.setattr(regen_mod.JsonlAppender, "append", append)
    monkeypatch.setattr(regen_mod, "atomic_write_json", write)
    with pytest.raises(KeyboardInterrupt):
        _regen(cfg, llama, out)
    lost = seen["rows"]
    assert lost > 0
    monkeypatch.setattr(regen_mod, "atomic_write_json", real_write)
    state = _regen(cfg, llama, out)
    assert _rows(out) == reference
    assert state["rows_uncounted"] == lost and state["rows_written"] == clean["rows_written"]
    assert state["generated_tokens"] < clean["generated_tokens"]


def test_resume_with_other_settings_or_a_foreign_file_is_refused(reference, cfg, llama, tmp_path):
    out = tmp_path / "ref.jsonl"
    with pytest.raises(ValidationError, match="max_new_tokens"):
        run_regenerate(cfg, out, max_new_tokens=NEW + 1, batch_size=2, device="cpu", bundle=llama)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "z", "messages": []}\n')
    with pytest.raises(ValidationError, match="no progress sidecar"):
        _regen(cfg, llama, foreign)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    sidecar_path(bad).write_text(sidecar_path(out).read_text())
    with pytest.raises(ValidationError, match="bad.jsonl:1"):
        _regen(cfg, llama, bad)


def test_a_larger_max_samples_extends_the_file_to_the_direct_run(reference, cfg, llama, tmp_path):
    """Regenerating 3 conversations, then asking for all of them, writes what one run over all writes;
    a smaller max_samples than the file's is still refused."""
    out = tmp_path / "grown.jsonl"
    cfg.data.max_samples = 3
    _regen(cfg, llama, out)
    assert _rows(out)[1] == ["a", "src:2", "c"]
    cfg.data.max_samples = 0
    state = _regen(cfg, llama, out)
    assert _rows(out) == reference and state["settings"]["max_samples"] == 0
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    small = tmp_path / "small.jsonl"
    cfg.data.max_samples = 4
    _regen(cfg, llama, small)
    cfg.data.max_samples = 2
    with pytest.raises(ValidationError, match="max_samples"):
        _regen(cfg, llama, small)


def test_too_long_prompts_stop_the_conversation_or_skip_it(cfg, llama, tmp_path):
    out = tmp_path / "short.jsonl"
    tok = llama.tokenizer
    f_first = next(r for r in ROWS if r.get("id") == "f")["messages"][:1]
    cfg.extract.max_length = len(encode_prompt(tok, f_first)) + NEW + 2   # f's first turn fits, its second not
    state = _regen(cfg, llama, out)
    by_id, _ = _rows(out)
    assert [m["role"] for m in by_id["f"]] == ["user", "assistant"]
    for msgs in by_id.values():                  # every regenerated turn had room for max_new_tokens
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert len(encode_prompt(tok, msgs[:i])) + NEW <= cfg.extract.max_length
    assert state["skipped"] and set(state["skipped"]) | set(by_id) == {"a", "src:2", "c", "e", "f", "g"}
    src = _source_messages()
    for sid, reason in state["skipped"].items():
        assert "max_length" in reason
        first_user = next(m for m in src[sid] if m["role"] == "user")
        head = [m for m in src[sid] if m["role"] == "system"] + [first_user]
        assert len(encode_prompt(tok, head)) + NEW > cfg.extract.max_length


def test_max_turns_keeps_the_first_regenerated_turns_only(reference, cfg, llama, tmp_path):
    out = tmp_path / "first.jsonl"
    run_regenerate(cfg, out, max_new_tokens=NEW, batch_size=3, device="cpu", bundle=llama, max_turns=1)
    (first, _), (full, _) = _rows(out), reference
    assert set(first) == set(full)
    for sid, msgs in first.items():
        assert sum(m["role"] == "assistant" for m in msgs) == 1
        k = next(i for i, m in enumerate(full[sid]) if m["role"] == "assistant")
        assert msgs == full[sid][:k + 1]  # identical to the full run up to its first answer


def test_max_length_flag_overrides_the_manifest_and_refuses_negatives(tmp_path, monkeypatch, capsys):
    """`regenerate --max-length N` is the conversation cap (multi-turn runs need more than the manifest's
    first-turn 512); a negative value is a usage error (exit 2) naming the flag. `--overlap-prefill` and
    `--compact-tail` reach run_regenerate (off by default)."""
    from typer.testing import CliRunner

    from dflash_pipe.cli import app

    seen = {}
    monkeypatch.setattr(regen_mod, "run_regenerate", lambda cfg, out, **kw: seen.update(
        max_length=cfg.extract.max_length, overlap=kw["overlap"] or kw["compact"] and "compact"))
    # (a negative value must stop before run_regenerate: 'seen' would change)
    out = str(tmp_path / "o.jsonl")
    res = CliRunner().invoke(app, ["regenerate", "-o", out, "--max-length", "1280", "--overlap-prefill"])
    assert res.exit_code == 0, res.output
    assert seen == {"max_length": 1280, "overlap": True}
    res = CliRunner().invoke(app, ["regenerate", "-o", out])
    assert res.exit_code == 0 and seen == {"max_length": RunConfig().extract.max_length, "overlap": False}
    from dflash_pipe.cli import main

    with pytest.raises(SystemExit) as err:
        main(["regenerate", "-o", out, "--max-length", "-1"])
    assert err.value.code == 2 and seen == {"max_length": RunConfig().extract.max_length, "overlap": False}
    assert "--max-length must be >= 0" in capsys.readouterr().err
    res = CliRunner().invoke(app, ["regenerate", "-o", out, "--compact-tail"])
    assert res.exit_code == 0 and seen["overlap"] == "compact"


def test_history_reuse_gives_the_same_conversations_prefilling_only_the_new_tokens(reference, cfg, llama, tmp_path):
    """--reuse-history: later turns continue in the row that wrote the previous answer, prefilling only what follows
    it; the conversations equal the full-prefill run's (fp32), greedy and sampled, and far fewer tokens are
    prefilled. With the held tokens made not to match (fault injected), every turn falls back to a full prefill,
    with the same output."""
    out = tmp_path / "reuse.jsonl"
    state = _regen(cfg, llama, out, reuse_history=True)
    assert _rows(out) == reference
    t = state["timing"]
    assert t["history_prefills"] > 0 and t["history_reused_tokens"] > 0
    sampled = dict(samples=2, temperature=1.0, top_p=0.9, seed=3, greedy_after=2)
    plain, reuse = tmp_path / "s-plain.jsonl", tmp_path / "s-reuse.jsonl"
    _regen(cfg, llama, plain, **sampled)
    _regen(cfg, llama, reuse, reuse_history=True, **sampled)
    assert _rows(reuse) == _rows(plain)


def test_chunked_prefill_gives_the_padded_prefills_conversations_and_pads_less(reference, cfg, llama, tmp_path):
    """--prefill-layout chunks (CUDA's default) against padded, also with history reuse (its appends stay padded):
    the same greedy conversations (fp32), fewer padded prefill tokens; a bad layout is a usage error. (Sampled
    answers are not compared: the random target's flat distributions turn the two paths' 1e-5 rounding
    differences into other draws.)"""
    out = tmp_path / "chunks.jsonl"
    chunked = _regen(cfg, llama, out, prefill_layout="chunks")
    padded = _regen(cfg, llama, tmp_path / "padded.jsonl", prefill_layout="padded")
    assert _rows(out) == reference
    assert "chunks prefill" in chunked["decode_path"] and "padded prefill" in padded["decode_path"]
    assert chunked["timing"]["prefill_pad_share"] < padded["timing"]["prefill_pad_share"]
    reuse = tmp_path / "chunks-reuse.jsonl"
    state = _regen(cfg, llama, reuse, prefill_layout="chunks", reuse_history=True)
    assert _rows(reuse) == reference and state["timing"]["history_prefills"] > 0
    with pytest.raises(UsageError, match="--prefill-layout"):
        _regen(cfg, llama, tmp_path / "bad.jsonl", prefill_layout="packed")


def test_history_reuse_falls_back_when_the_new_prompt_does_not_extend_the_row(reference, cfg, llama, tmp_path,
                                                                               monkeypatch):
    from dflash_pipe.eval.regen_backends import EngineBackend

    real = EngineBackend.collect

    def corrupt(self):
        comps = real(self)
        for h in self.held.values():
            h.fed = h.fed[:-1] + [h.fed[-1] + 1]          # the row's last token no longer matches the re-rendered prompt
        return comps

    monkeypatch.setattr(EngineBackend, "collect", corrupt)
    out = tmp_path / "fallback.jsonl"
    state = _regen(cfg, llama, out, reuse_history=True)
    assert _rows(out) == reference
    assert state["timing"]["history_prefills"] == 0 and state["timing"]["history_reused_tokens"] == 0


def test_history_reuse_with_tail_compaction_is_refused(llama):
    """Compaction moves live rows; a held row must stay where its K/V are: the two are refused together."""
    from dflash_pipe.errors import UsageError
    from dflash_pipe.eval.regen_backends import EngineBackend
    from dflash_pipe.eval.regen_sampling import Decoding

    with pytest.raises(UsageError, match="tail compaction"):
        EngineBackend(llama.model, [2], batch=2, max_len=64, max_new_tokens=4, dec=Decoding(), compact=True,
                      reuse_history=True)


def test_max_seconds_stops_admitting_finishes_the_flight_and_a_rerun_completes_it(reference, cfg, llama, tmp_path,
                                                                                    monkeypatch):
    """The clock passes the limit after the first round: the conversations admitted by then are finished and
    written (a prefix of the direct run, identical content), the sidecar says so, and a rerun without the
    limit gives the direct run's file."""
    ticks = iter([0.0, 0.0])                    # the start, round 1; every later look is past the limit
    monkeypatch.setattr(regen_mod, "_now", lambda: next(ticks, 1e9))
    out = tmp_path / "capped.jsonl"
    state = _regen(cfg, llama, out, max_seconds=5.0)
    by_id, order = _rows(out)
    ref_by_id, ref_order = reference
    assert 0 < len(order) < len(ref_order) and order == ref_order[:len(order)]
    assert all(by_id[i] == ref_by_id[i] for i in order)
    assert state["stopped_early"]["max_seconds"] == 5.0
    assert state["timing"]["setup_s"] >= 0 and state["timing"]["wall_s"] > 0   # set-up timed apart from the loop
    assert json.loads(sidecar_path(out).read_text())["stopped_early"]["max_seconds"] == 5.0
    monkeypatch.setattr(regen_mod, "_now", lambda: 0.0)
    state = _regen(cfg, llama, out)
    assert _rows(out) == reference and "stopped_early" not in state
    with pytest.raises(UsageError, match="--max-seconds must be >= 0"):
        _regen(cfg, llama, tmp_path / "x.jsonl", max_seconds=-1)
