"""GPU checks of the target runner: FLA varlen kernels keep packed documents exact (H200, `pytest -m gpu`).

Needs CUDA plus flash-linear-attention 0.6.0 (`pip install -e '.[gpu]'`). Compared with the
same kernels on both sides (SPEC §3): each document packed with others vs the same document
alone through the same FLA varlen path; plus the plain HF forward as an independent reference.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_pipe.target import TargetRunner, load_target, standalone_features
from dflash_pipe.target.loading import build_random_model
from dflash_pipe.target.packing import make_packed_row, packed_position_ids

pytestmark = pytest.mark.gpu

# Lengths around FLA's 64-token chunks, one shorter than the conv kernel (4), like SPEC §3's 300/517/211.
DOC_LENS = [300, 3, 517, 64, 211]
LAYERS = [0, 2, 3, 5, 7]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "dflash-model-cache"


def _docs() -> list[torch.Tensor]:
    """Synthetic token ids (no tokenizer: the SmolLM2 GGUF package need not be on the GPU machine)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=g) for n in DOC_LENS]


def _load(dtype, cache):
    return load_target("random:tiny-qwen3.5", device="cuda", dtype=dtype, model_cache_dir=cache,
                       with_tokenizer=False)


def _run_packed(runner, docs):
    ids = torch.cat(docs).cuda()
    return runner.run(ids, [d.numel() for d in docs])


# Measured on an H200 (torch 2.11, transformers 5.17, FLA 0.6.0): packed vs alone through the FLA
# path <= 5.2e-3 (bf16) / 2.4e-5 (fp32); FLA path vs the HF forward <= 8.7e-3 / 2.4e-5.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-4)])
def test_fla_packed_equals_fla_standalone(dtype, tol, cache, caplog):
    bundle = _load(dtype, cache)
    docs = _docs()
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        runner = TargetRunner(bundle, LAYERS, topk=8, linear_attn_kernels="fla", hidden_dtype=None)
    try:
        assert runner.linear_path == "fla"
        assert runner.kernel_paths["linear_attention"].startswith("fla")
        assert any("linear_attention layers: fla" in r.getMessage() for r in caplog.records)
        packed = _run_packed(runner, docs)
        start = 0
        for d in docs:
            alone = runner.run(d.cuda(), [d.numel()])
            got = packed.hidden_TD[start:start + d.numel()]
            assert _rel(got, alone.hidden_TD) < tol, (d.numel(), _rel(got, alone.hidden_TD))
            agree = (packed.topk_ids_TK[start:start + d.numel(), 0] == alone.topk_ids_TK[:, 0]).float().mean()
            assert agree > 0.95
            start += d.numel()
    finally:
        runner.close()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 2e-4)])
def test_fla_packed_close_to_hf_forward(dtype, tol, cache):
    """Against the plain HF forward (FLA recurrence, torch conv) of each document alone."""
    bundle = _load(dtype, cache)
    docs = _docs()
    with TargetRunner(bundle, LAYERS, topk=0, linear_attn_kernels="auto", hidden_dtype=None) as runner:
        assert runner.linear_path == "fla"
        packed = _run_packed(runner, docs)
    start = 0
    for j, d in enumerate(docs):
        ref = standalone_features(bundle, d.cuda(), LAYERS).hidden_TD
        got = packed.hidden_TD[start:start + d.numel()]
        assert _rel(got, ref) < tol, (j, _rel(got, ref))
        start += d.numel()


def test_naive_packing_leaks_on_gpu(cache):
    """transformers' own packed forward (restarted positions, FLA recurrence without cu_seqlens, torch
    conv) contaminates the first tokens of every later document: the tests above could fail."""
    bundle = _load(torch.float32, cache)
    docs = _docs()
    lens = [d.numel() for d in docs]
    ids = torch.cat(docs).cuda()
    row = make_packed_row(lens, ids.numel())
    with torch.inference_mode():
        out = bundle.model(input_ids=ids[None], position_ids=packed_position_ids(row, ids.device),
                           use_cache=False, output_hidden_states=True)
    naive = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
    start = 0
    for j, d in enumerate(docs):
        head = min(16, d.numel())
        ref = standalone_features(bundle, d.cuda(), LAYERS).hidden_TD[:head]
        err = _rel(naive[start:start + head], ref)
        assert (err < 1e-4) if j == 0 else (err > 1e-2), (j, err)
        start += d.numel()


def test_27b_shape_builds_on_cuda_in_bf16_without_cpu_copy():
    """Truncated to 4 layers (one 3 GDN + 1 full group): the full model is a benchmark, not a test."""
    import psutil

    rss0 = psutil.Process().memory_info().rss
    model = build_random_model("qwen3.5-27b-shape", seed=0, device=torch.device("cuda"), dtype=torch.bfloat16,
                               num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.cuda.synchronize()
    rss1 = psutil.Process().memory_info().rss
    params = list(model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    nbytes = sum(p.numel() * 2 for p in params)
    assert nbytes > 6e9                                    # two 248320 x 5120 matrices + 4 layers
    assert rss1 - rss0 < 0.25 * nbytes, (rss1 - rss0, nbytes)
    c = model.config
    assert (c.hidden_size, c.vocab_size, c.linear_num_value_heads, c.head_dim) == (5120, 248320, 48, 256)
    del model, params
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 2e-4)])
def test_padded_layout_equals_packed_on_gpu(dtype, tol, cache):
    """`extract --attention-layout padded` on CUDA (flash/efficient SDPA over right-padded rows) gives the packed
    row's features (masked SDPA over one block-diagonal row) and each document's standalone forward's. The
    quality driver's precheck runs this before its `QUALITY_EXTRACT_LAYOUT=auto` may pick the padded layout."""
    bundle = load_target("random:tiny-llama", device="cuda", dtype=dtype, model_cache_dir=cache,
                         with_tokenizer=False)
    docs = _docs()
    ids = torch.cat(docs).cuda()
    lens = [d.numel() for d in docs]
    with TargetRunner(bundle, LAYERS, topk=8, hidden_dtype=None, layout="padded") as runner:
        padded = runner.run(ids, lens)
    with TargetRunner(bundle, LAYERS, topk=8, hidden_dtype=None) as runner:
        packed = runner.run(ids, lens)
    assert padded.hidden_TD.shape == packed.hidden_TD.shape
    assert _rel(padded.hidden_TD, packed.hidden_TD) < tol
    assert (padded.topk_ids_TK[:, 0] == packed.topk_ids_TK[:, 0]).float().mean() > 0.95
    start = 0
    for d in docs:
        ref = standalone_features(bundle, d.cuda(), LAYERS).hidden_TD
        got = padded.hidden_TD[start:start + d.numel()]
        assert _rel(got, ref) < tol, (d.numel(), _rel(got, ref))
        start += d.numel()
