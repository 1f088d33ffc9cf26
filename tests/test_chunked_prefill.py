"""The static-KV engine's chunked prefill (chunked_prefill.py) against HF's forward of each prompt alone (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.errors import UsageError
from dflash_pipe.target.chunked_prefill import CHUNK, chunk_bucket, chunk_layout
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.test_static_forward import _hf, _model, _rel, _small


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3Config

    return {"llama": _model("tiny-llama"), "qwen3": _small(Qwen3Config, head_dim=16)}


def test_chunk_layout_cuts_prompts_into_16_token_chunks_and_pads_with_the_pad_row():
    ids, rows, starts, counts, last = chunk_layout([list(range(1, 18)), [7, 8]], [5, 2], 6, pad_row=9)
    assert len(ids) == 6 * CHUNK
    assert ids[:16] == list(range(1, 17)) and ids[16:18] == [17, 0] and ids[32:34] == [7, 8]
    assert rows == [5, 5, 2, 9, 9, 9] and starts == [0, 16, 0, 0, 0, 0] and counts == [16, 1, 2, 0, 0, 0]
    assert last == [1, 2]
    with pytest.raises(ValueError, match="do not fit"):
        chunk_layout([list(range(40))], [0], 2, pad_row=9)
    assert [chunk_bucket(n) for n in (1, 8, 9, 17, 33, 65, 200, 257)] == [8, 8, 16, 24, 40, 80, 224, 320]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_chunked_prefill_equals_each_prompt_alone_and_leaves_other_rows_alone(models, name):
    """Prompts of 1 to 40 tokens (chunk edges at 16 and 32) into reset rows that held longer sequences: the logits
    at each prompt's last token and its K/V equal HF / a padded engine's; live rows keep their K/V bit for bit;
    the lengths are the prompts'; decode steps after it equal HF's forward of the whole sequence."""
    model = models[name]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(11)
    old = [torch.randint(0, V, (n,), generator=g).tolist() for n in (60, 45)]
    live = torch.randint(0, V, (23,), generator=g).tolist()
    new = [torch.randint(0, V, (n,), generator=g).tolist() for n in (16, 40, 1, 17, 33)]
    eng = StaticKVEngine(model, max_batch=7, max_len=80, kv_bucket=8, bucketed_prefill=True, prefill_layout="chunks")
    ref = StaticKVEngine(model, max_batch=7, max_len=80, kv_bucket=8, bucketed_prefill=True, prefill_layout="padded")
    assert eng.prefill_layout == "chunks" and ref.prefill_layout == "padded"
    eng.prefill(old, [0, 1])
    eng.prefill([live], [6])
    eng.reset([0, 1])
    kept = (eng.k_cache[:, 6].clone(), eng.v_cache[:, 6].clone())
    rows = [1, 4, 0, 2, 5]
    got = eng.prefill(new, rows)
    assert eng.last_prefill_shape == (1 + 3 + 1 + 2 + 3, CHUNK)      # 10 chunks, no bucket padding on the CPU
    want = ref.prefill(new, rows)
    assert got.shape == (5, V) and _rel(got, want) <= 1e-5
    for i, p in enumerate(new):
        assert _rel(got[i], _hf(model, p)[0][-1]) <= 1e-5
    for r, p in zip(rows, new):
        n = len(p)
        assert _rel(eng.k_cache[:, r, :, :n], ref.k_cache[:, r, :, :n]) <= 1e-5
        assert _rel(eng.v_cache[:, r, :, :n], ref.v_cache[:, r, :, :n]) <= 1e-5
    assert torch.equal(eng.k_cache[:, 6], kept[0]) and torch.equal(eng.v_cache[:, 6], kept[1])
    assert [eng.length(r) for r in range(8)] == [1, 16, 17, 0, 40, 33, 23, 0]
    seqs = {r: list(p) for r, p in zip(rows, new)}
    seqs[6] = list(live)
    for step in range(3):                       # decode on every row; row 3 is empty (num_new 0)
        nxt = torch.randint(0, V, (7, 1), generator=g)
        out = eng.forward(nxt, torch.tensor([0 if r == 3 else 1 for r in range(7)]))
        for r, s in seqs.items():
            s.append(int(nxt[r, 0]))
            assert _rel(out.logits[r, 0], _hf(model, s)[0][-1]) <= 1e-5, (name, step, r)


def test_chunked_prefill_appends_padded_into_rows_that_are_not_empty_and_refuses_bad_layouts(models):
    model = models["llama"]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    first, more = (torch.randint(0, V, (n,), generator=g).tolist() for n in (20, 9))
    eng = StaticKVEngine(model, max_batch=2, max_len=64, kv_bucket=8, bucketed_prefill=True, prefill_layout="chunks")
    eng.prefill([first], [1])
    got = eng.prefill([more], [1])                # row 1 holds 20 tokens: the padded append path
    assert eng.last_prefill_shape != (1, CHUNK) and eng.length(1) == 29
    assert _rel(got[0], _hf(model, first + more)[0][-1]) <= 1e-5
    with pytest.raises(UsageError, match="prefill_layout"):
        StaticKVEngine(model, max_batch=2, max_len=64, bucketed_prefill=True, prefill_layout="packed")
    assert StaticKVEngine(model, 2, 64, bucketed_prefill=True).prefill_layout == "padded"   # auto on the CPU
