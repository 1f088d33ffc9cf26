"""Top-k next-token log-probs: equal to a float64 log_softmax reference, independent of chunking.

bf16 logits are checked up to the order of exactly tied values (tests/topk_helpers.py), also
through the inductor-compiled logsumexp on the CPU (the path CUDA takes by default).
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.target import TargetRunner, load_target
from dflash_pipe.target.runner_utils import chunked_topk_logprobs
from dflash_pipe.target.topk import row_logsumexp
from tests.topk_helpers import assert_valid_topk, fp16_close, tied_bf16_logits

TEXT = ["Once upon a time there was a small language model that wanted to draft tokens.",
        "It packed documents into rows, and every row had to be exact."]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_target("random:tiny-qwen3.5", dtype="float32",
                       model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache")


_fp16_close = fp16_close


def test_topk_matches_float64_log_softmax(bundle):
    k = 16
    ids = [bundle.tokenizer.encode(t) for t in TEXT]
    flat, lens = torch.tensor(sum(ids, [])), [len(x) for x in ids]
    with TargetRunner(bundle, [1], topk=k, linear_attn_kernels="torch", hidden_dtype=None) as runner:
        out = runner.run(flat, lens)
    start = 0
    for doc in ids:
        with torch.inference_mode():
            logits = bundle.model(input_ids=torch.tensor(doc)[None], use_cache=False).logits[0]
        ref_lp, ref_ids = torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1)
        got_ids = out.topk_ids_TK[start:start + len(doc)]
        got_lp = out.topk_logprobs_TK[start:start + len(doc)]
        assert torch.equal(got_ids.long(), ref_ids)
        _fp16_close(got_lp, ref_lp)
        assert bool((got_lp[:, :-1] >= got_lp[:, 1:]).all())      # descending
        assert bool((got_lp <= 0).all())
        start += len(doc)


def test_chunking_does_not_change_topk(bundle):
    torch.manual_seed(0)
    hidden = torch.randn(37, bundle.hidden_size)
    head = bundle.model.get_output_embeddings()
    with torch.inference_mode():
        base_ids, base_lp = chunked_topk_logprobs(hidden, head, 8, chunk=4096)
        for chunk in (1, 5, 36):
            ids, lp = chunked_topk_logprobs(hidden, head, 8, chunk=chunk)
            assert torch.equal(ids, base_ids)
            torch.testing.assert_close(lp, base_lp, rtol=0, atol=1e-3)
        ref_lp, ref_ids = torch.log_softmax(head(hidden).double(), -1).topk(8, dim=-1)
    assert torch.equal(base_ids.long(), ref_ids)
    _fp16_close(base_lp, ref_lp)


def test_runner_logits_chunk_invariant(bundle):
    ids = torch.tensor(bundle.tokenizer.encode(TEXT[0] + " " + TEXT[1]))
    outs = []
    for chunk in (3, 2048):
        with TargetRunner(bundle, [2], topk=4, linear_attn_kernels="torch", logits_chunk=chunk) as runner:
            outs.append(runner.run(ids, [ids.numel()]))
    assert torch.equal(outs[0].topk_ids_TK, outs[1].topk_ids_TK)
    torch.testing.assert_close(outs[0].topk_logprobs_TK, outs[1].topk_logprobs_TK, rtol=0, atol=1e-3)


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_logits_with_ties_and_short_tail(compiled):
    """bf16 blocks straight into top-k (no fp32 copy): 37 rows in chunks of 16 (tail of 5)."""
    k = 8
    logits = tied_bf16_logits(37, 3000, k)
    with torch.inference_mode():
        ids, lp = chunked_topk_logprobs(logits, torch.nn.Identity(), k, chunk=16, compiled=compiled)
        whole_ids, whole_lp = chunked_topk_logprobs(logits, torch.nn.Identity(), k, chunk=4096, compiled=compiled)
    assert_valid_topk(ids, lp, logits, k)
    assert_valid_topk(whole_ids, whole_lp, logits, k)
    torch.testing.assert_close(lp, whole_lp, rtol=0, atol=0)
    assert bool((lp[0] == lp[0, 0]).all()) and bool((lp[1] == lp[1, 0]).all())   # the crafted tie rows
    assert abs(float(lp[0, 0]) + torch.log(torch.tensor(3000.0)).item()) < 1e-2


def test_bf16_head_with_softcap():
    """Softcap is applied to the bf16 logits (in bf16, like the HF forward), then normalised."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 500, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(37, 32, dtype=torch.bfloat16) * 4
    cap = 5.0
    with torch.inference_mode():
        ids, lp = chunked_topk_logprobs(hidden, head, 8, chunk=16, softcap=cap)
        plain_ids, plain_lp = chunked_topk_logprobs(hidden, head, 8, chunk=16)
        logits = head(hidden)
    assert_valid_topk(ids, lp, torch.tanh(logits / cap) * cap, 8)
    assert_valid_topk(plain_ids, plain_lp, logits, 8)
    assert float((lp.float() - plain_lp.float()).abs().max()) > 0.1     # the cap did something


def test_compiled_logsumexp_equals_float64():
    """The compiled fp32-accumulating reduction (dynamic rows) vs float64, on bf16 and fp32 inputs with -inf."""
    g = torch.Generator().manual_seed(2)
    for rows, dtype in ((37, torch.bfloat16), (5, torch.bfloat16), (6, torch.float32)):
        x = (torch.randn(rows, 3000, generator=g) * 4).to(dtype)
        x[:, ::7] = float("-inf")
        x[0, 5] = 60.0
        want = torch.logsumexp(x.double(), dim=-1, keepdim=True)
        for compiled in (True, False):
            got = row_logsumexp(x, compiled=compiled)
            assert got.dtype == torch.float32 and got.shape == (rows, 1)
            torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=2e-6)


@pytest.mark.parametrize("V,k,segment", [(4096, 8, 64), (4099, 8, 64), (5000, 32, 16), (1000, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_segmented_topk_equals_torch_topk(V, k, segment, dtype, ties):
    """Same values as torch.topk, sorted; ids distinct, in range and pointing at those values. Covers a
    vocab that is not a multiple of the segment (the tail columns), heavy ties, and -inf entries."""
    from dflash_pipe.target.topk import segmented_topk

    g = torch.Generator().manual_seed(V + k)
    x = (torch.randint(0, 12, (48, V), generator=g).float() if ties else torch.randn(48, V, generator=g) * 3)
    x[0, :] = float("-inf")
    x[0, V - 1] = 5.0                      # the row's only finite value sits in the tail (or last segment)
    x[1, V - (V % segment or segment):] += 100.0   # the tail dominates a row
    x = x.to(dtype)
    vals, ids = segmented_topk(x, k, segment)
    assert torch.equal(vals, torch.topk(x, k, dim=-1).values)
    assert torch.equal(torch.gather(x, 1, ids), vals)
    assert bool(((ids >= 0) & (ids < V)).all())
    assert all(len(set(row)) == k for row in ids.tolist())


def test_segmented_topk_falls_back_when_segments_are_too_few():
    from dflash_pipe.target.topk import segmented_topk

    x = torch.randn(4, 300)
    vals, ids = segmented_topk(x, 8, 64)   # 4 full segments < k: the plain top-k
    ref = torch.topk(x, 8, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(ids, ref.indices)
