"""A decode step that prefills new prompts on the way (target/mixed_step.py) against a chunked prefill followed by
the decode step, and against HF's forward of each whole sequence (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.errors import UsageError
from dflash_pipe.target.mixed_step import decode_with_prefill
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.test_static_forward import _hf, _model, _rel, _small


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3Config

    return {"llama": _model("tiny-llama"), "qwen3": _small(Qwen3Config, head_dim=16)}


def _engines(model):
    kw = dict(max_batch=6, max_len=80, kv_bucket=8, bucketed_prefill=True, prefill_layout="chunks")
    return StaticKVEngine(model, **kw), StaticKVEngine(model, **kw)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decode_with_prefill_equals_a_chunked_prefill_then_the_step(models, name):
    """Rows 0, 2, 5 decode (lengths 30, 7, 51); rows 1, 3 take prompts of 17 and 33 tokens (chunk edges) in the same
    step, row 1 after a longer occupant was reset, row 4 stays empty. Decode logits, prompt logits, every row's
    K/V and length equal the reference engine's prefill + forward; three plain steps later every live row's logits
    still equal HF's forward of its whole sequence."""
    model = models[name]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    seqs = {r: torch.randint(0, V, (n,), generator=g).tolist() for r, n in ((0, 30), (1, 60), (2, 7), (5, 51))}
    mixed, ref = _engines(model)
    for eng in (mixed, ref):
        for r, s in seqs.items():
            eng.prefill([s], [r])
        eng.reset([1])
    del seqs[1]
    prompts = {1: torch.randint(0, V, (17,), generator=g).tolist(), 3: torch.randint(0, V, (33,), generator=g).tolist()}
    ids = torch.randint(0, V, (6, 1), generator=g)
    num = torch.tensor([1, 0, 1, 0, 0, 1])
    logits, first = decode_with_prefill(mixed, ids, num, list(prompts.values()), list(prompts))
    want_first = ref.prefill(list(prompts.values()), list(prompts)).clone()
    want = ref.forward(ids, num).logits
    assert first.shape == (2, V) and _rel(first, want_first) <= 1e-5
    for r in (0, 2, 5):
        assert _rel(logits[r], want[r]) <= 1e-5
        seqs[r].append(int(ids[r, 0]))
    for i, p in enumerate(prompts.values()):
        assert _rel(first[i], _hf(model, p)[0][-1]) <= 1e-5
    lengths = [mixed.length(r) for r in range(6)]
    assert lengths == [ref.length(r) for r in range(6)] == [31, 17, 8, 33, 0, 52]
    for r, n in enumerate(lengths):
        if not n:
            continue
        assert _rel(mixed.k_cache[:, r, :, :n], ref.k_cache[:, r, :, :n]) <= 1e-5, r
        assert _rel(mixed.v_cache[:, r, :, :n], ref.v_cache[:, r, :, :n]) <= 1e-5, r
    seqs.update({r: list(p) for r, p in prompts.items()})
    for _ in range(3):
        nxt = torch.randint(0, V, (6, 1), generator=g)
        out = mixed.forward(nxt, torch.tensor([0 if r == 4 else 1 for r in range(6)]))
        for r, s in seqs.items():
            s.append(int(nxt[r, 0]))
            assert _rel(out.logits[r, 0], _hf(model, s)[0][-1]) <= 1e-5, (name, r)


def test_decode_with_prefill_refuses_rows_that_are_not_empty_or_outside_the_step(models):
    mixed, _ = _engines(models["llama"])
    mixed.prefill([[1, 2, 3]], [2])
    ids, num = torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    with pytest.raises(UsageError, match="empty row"):
        decode_with_prefill(mixed, ids, num, [[5, 6]], [2])           # row 2 holds 3 tokens
    with pytest.raises(UsageError, match="empty row"):
        decode_with_prefill(mixed, ids, num, [[5, 6]], [4])           # row 4 is not among the step's 4
    with pytest.raises(UsageError, match="outside 1..80"):
        decode_with_prefill(mixed, ids, num, [list(range(81))], [1])
