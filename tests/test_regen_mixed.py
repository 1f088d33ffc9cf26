"""regenerate's mixed prefill layout on the CPU (eval/regen_backends.py + target/mixed_step.py): a refill's prompts
ride in the launch's first decode step and the answers stay the direct path's."""

from __future__ import annotations

import pytest

from dflash_pipe.errors import UsageError
from dflash_pipe.eval.regen_backends import EngineBackend
from dflash_pipe.eval.regen_sampling import Decoding
from tests.eval_helpers import drain_backend, llama  # noqa: F401 - pytest fixture
from dflash_pipe.eval.regenerate import run_regenerate
from tests.test_eval_regenerate import _rows, cfg  # noqa: F401 - pytest fixture
from tests.test_regen_overlap import EOS, _answers, _prompts


def test_mixed_steps_give_the_direct_answers_with_the_same_decode_work(llama):
    """30 prompts through 4 slots, 3 and 5 steps a launch, answers collected at the launch's end, 1 step early and
    from the copy taken as a launch starts (then a row refilled in that launch must not be read as finished):
    every answer (sampled, greedy-after-3, greedy) equals the direct path's with chunked prefills; all refills
    but those made while no row decodes (the first fill) ride in decode steps; the rows decoded per step add up to the direct path's (the same tokens, other steps)."""
    prompts = _prompts(30, seed=17)
    for dec in (Decoding(temperature=0.9, top_p=0.95, seed=3), Decoding(temperature=1.2, greedy_after=3, seed=1),
                Decoding()):
        direct, ref = _answers(llama.model, prompts, dec, prefill_layout="chunks", snapshot_lag=0)
        for lag, every in ((0, 3), (1, 3), (5, 5)):
            be = EngineBackend(llama.model, EOS, batch=4, max_len=96, max_new_tokens=14, dec=dec, check_every=every,
                               prefill_layout="mixed", snapshot_lag=lag)
            got = drain_backend(be, prompts, key_offset=100)
            assert got == direct, (dec, lag, every)
            st = be.stats()
            assert st["prefills_in_steps"] >= 10 and st["prefill_rows"] == 30, st
            assert st["prefill_calls"] - st["prefills_in_steps"] <= 3, st  # alone: when no row decodes
            live = be.snap.live_row_steps if be.snap is not None else int(be.live_row_steps)
            assert live == int(ref.live_row_steps) > 0
            assert "mixed (prompts ride in decode steps) prefill" in be.describe


def test_mixed_layout_through_regenerate_gives_the_chunked_conversations(cfg, llama, tmp_path, monkeypatch):
    """Every turn at batch 3, a fifth of the vocabulary ending an answer (so answers end at many steps and refills
    ride in decode steps), with and without history reuse (its appends stay separate prefill calls): the same
    conversations as chunked prefills, greedy and sampled; refused beside --overlap-prefill."""
    from dflash_pipe.eval import regenerate as regen_mod

    monkeypatch.setattr(regen_mod, "eos_token_ids", lambda model, tok: EOS)
    for i, kw in enumerate(({}, {"reuse_history": True}, {"samples": 2, "temperature": 1.0, "seed": 3})):
        want, got = tmp_path / f"chunks{i}.jsonl", tmp_path / f"mixed{i}.jsonl"
        run_regenerate(cfg, want, max_new_tokens=8, batch_size=3, device="cpu", bundle=llama, steps_per_launch=3,
                       prefill_layout="chunks", **kw)
        state = run_regenerate(cfg, got, max_new_tokens=8, batch_size=3, device="cpu", bundle=llama,
                               steps_per_launch=3, prefill_layout="mixed", **kw)
        assert _rows(got) == _rows(want), kw
        assert state["timing"]["prefills_in_steps"] > 0, state["timing"]
    with pytest.raises(UsageError, match="choose one"):
        EngineBackend(llama.model, EOS, batch=4, max_len=96, max_new_tokens=6, dec=Decoding(),
                      prefill_layout="mixed", overlap=True)
