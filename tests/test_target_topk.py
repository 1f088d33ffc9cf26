"""Top-k next-token log-probs: equal to a float64 log_softmax reference, independent of chunking."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.target import TargetRunner, load_target
from dflash_pipe.target.runner_utils import chunked_topk_logprobs

TEXT = ["Once upon a time there was a small language model that wanted to draft tokens.",
        "It packed documents into rows, and every row had to be exact."]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_target("random:tiny-qwen3.5", dtype="float32",
                       model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache")


def _fp16_close(got_fp16: torch.Tensor, ref_f64: torch.Tensor) -> None:
    """Within one fp16 rounding step of the float64 value (what an fp16 store can promise)."""
    err = (got_fp16.double() - ref_f64).abs()
    ulp = torch.finfo(torch.float16).eps * ref_f64.abs().clamp_min(2 ** -14)
    assert bool((err <= ulp).all()), float((err / ulp).max())


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
