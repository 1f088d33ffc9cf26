"""Packed target forwards give each document exactly its standalone features (CPU, float32).

The reference is `standalone_features`: the plain HF forward of one document with
output_hidden_states=True. The "naive" packed forwards show that the comparison can fail:
without the GDN state reset (hybrid model) or without the document mask (Llama) the packed
features are far off.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_pipe.errors import RuntimeFailure, UsageError, ValidationError
from dflash_pipe.target import TargetRunner, load_target, standalone_features
from dflash_pipe.target.packing import FLA_CHUNK, block_causal_mask, make_packed_row, packed_position_ids, stage_row

DOCS = [
    "The first document is about cats and the way they sleep for most of the day.",
    "A second, longer one: the quick brown fox jumps over the lazy dog, again and again, until the dog "
    "finally wakes up and wonders what all the fuss was about. Then it goes back to sleep.",
    "Short.",
    "def add(a, b):\n    return a + b\n",
]
LAYERS = [0, 2, 5, 7]          # 8-layer presets: GDN and full-attention layers, and the last one


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    # Shared by every target test module in the session (the tokenizer is extracted once).
    return tmp_path_factory.getbasetemp() / "dflash-model-cache"


@pytest.fixture(scope="module", params=["random:tiny-qwen3.5", "random:tiny-llama"])
def bundle(request, model_cache):
    return load_target(request.param, device="cpu", dtype="float32", model_cache_dir=model_cache)


@pytest.fixture(scope="module")
def docs_ids(bundle):
    return [bundle.tokenizer.encode(d) for d in DOCS]


def _packed(docs_ids):
    return torch.tensor([t for d in docs_ids for t in d]), [len(d) for d in docs_ids]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_standalone(bundle, docs_ids, attn, model_cache):
    if attn != "sdpa":
        bundle = load_target(bundle.identity["model"], dtype="float32", model_cache_dir=model_cache,
                             attn_implementation=attn)
    ids, lens = _packed(docs_ids)
    assert len(set(lens)) == len(lens) and len(lens) >= 3
    with TargetRunner(bundle, LAYERS, topk=8, linear_attn_kernels="torch", hidden_dtype=None) as runner:
        out = runner.run(ids, lens)
    assert out.hidden_TD.shape == (ids.numel(), len(LAYERS) * bundle.hidden_size)
    start = 0
    for doc in docs_ids:
        ref = standalone_features(bundle, torch.tensor(doc), LAYERS, topk=8)
        got = out.hidden_TD[start:start + len(doc)]
        assert _rel(got, ref.hidden_TD) < 1e-5
        # each layer block separately, so a wrong layer order cannot hide in the norm
        H = bundle.hidden_size
        for j in range(len(LAYERS)):
            assert _rel(got[:, j * H:(j + 1) * H], ref.hidden_TD[:, j * H:(j + 1) * H]) < 1e-5
        assert torch.equal(out.topk_ids_TK[start:start + len(doc)], ref.topk_ids_TK)
        torch.testing.assert_close(out.topk_logprobs_TK[start:start + len(doc)].float(),
                                   ref.topk_logprobs_TK.float(), rtol=2e-3, atol=2e-3)
        start += len(doc)


def test_naive_packing_leaks(bundle, docs_ids):
    """Packed forwards without our handling do NOT match: the exactness test can fail."""
    ids, lens = _packed(docs_ids)
    row = make_packed_row(lens, ids.numel())
    with torch.inference_mode():
        if bundle.family == "qwen3.5":
            # Restarted positions only: transformers detects the packing for full attention, but
            # the Gated DeltaNet conv and recurrence run straight across the boundaries.
            out = bundle.model(input_ids=ids[None], position_ids=packed_position_ids(row, bundle.device),
                               use_cache=False, output_hidden_states=True)
        else:
            out = bundle.model(input_ids=ids[None], use_cache=False, output_hidden_states=True)
    naive = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
    errors, start = [], 0
    for doc in docs_ids:
        ref = standalone_features(bundle, torch.tensor(doc), LAYERS).hidden_TD
        errors.append(_rel(naive[start:start + len(doc)], ref))
        start += len(doc)
    assert errors[0] < 1e-5                       # the first document has nothing before it
    assert min(errors[1:]) > 1e-2, errors         # every later one is contaminated


def test_hooks_match_output_hidden_states_single_document(bundle, docs_ids):
    """Convention: feature of layer id == HF output_hidden_states[id + 1], every layer incl. the last."""
    all_layers = list(range(bundle.num_layers))
    doc = torch.tensor(docs_ids[1])
    with torch.inference_mode():
        hs = bundle.model(input_ids=doc[None], output_hidden_states=True, use_cache=False).hidden_states
    assert len(hs) == bundle.num_layers + 1
    with TargetRunner(bundle, all_layers, topk=0, linear_attn_kernels="torch", hidden_dtype=None) as runner:
        out = runner.run(doc, [doc.numel()])
    assert out.topk_ids_TK is None and out.topk_logprobs_TK is None
    H = bundle.hidden_size
    for j, layer_id in enumerate(all_layers):
        torch.testing.assert_close(out.hidden_TD[:, j * H:(j + 1) * H], hs[layer_id + 1][0], rtol=0, atol=0)


def test_bf16_feature_buffer(bundle, docs_ids):
    ids, lens = _packed(docs_ids)
    with TargetRunner(bundle, [1, 3], topk=4, linear_attn_kernels="auto") as runner:
        out = runner.run(ids, lens)
    assert out.hidden_TD.dtype == torch.bfloat16
    assert out.topk_ids_TK.dtype == torch.int32 and out.topk_logprobs_TK.dtype == torch.float16
    ref = standalone_features(bundle, torch.tensor(docs_ids[0]), [1, 3]).hidden_TD
    # a cast of the float32 features: equal up to one bf16 rounding step
    torch.testing.assert_close(out.hidden_TD[:len(docs_ids[0])].float(), ref, rtol=2 ** -8, atol=1e-6)


def test_block_causal_mask_matches_loops():
    lens = [3, 1, 4, 2]
    row = make_packed_row(lens, sum(lens))
    doc_of, pos_in_doc = [], []
    for d, n in enumerate(lens):
        doc_of += [d] * n
        pos_in_doc += list(range(n))
    T = sum(lens)
    dense = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(T):
            dense[q, k] = doc_of[q] == doc_of[k] and k <= q
    mask = block_causal_mask(row, torch.device("cpu"), "sdpa", torch.float32)
    assert mask.shape == (1, 1, T, T) and torch.equal(mask[0, 0], dense)
    eager = block_causal_mask(row, torch.device("cpu"), "eager", torch.float32)[0, 0]
    assert torch.equal(eager == 0, dense) and bool((eager[~dense] == torch.finfo(torch.float32).min).all())
    assert packed_position_ids(row, torch.device("cpu"))[0].tolist() == pos_in_doc
    assert block_causal_mask(make_packed_row([5], 5), torch.device("cpu"), "sdpa", torch.float32) is None


def test_stage_row_matches_loops():
    """One staged buffer = positions, document ids, cu_seqlens and FLA's chunk indices (doc, chunk in doc)."""
    lens = [1, 63, 64, 65, 130, 3]
    row = make_packed_row(lens, sum(lens))
    staged = stage_row(row, torch.device("cpu"), FLA_CHUNK)
    pos = [p for n in lens for p in range(n)]
    doc = [d for d, n in enumerate(lens) for _ in range(n)]
    chunks = [[d, c] for d, n in enumerate(lens) for c in range(-(-n // FLA_CHUNK))]
    assert staged.positions.shape == (1, sum(lens)) and staged.positions[0].tolist() == pos
    assert staged.doc_ids.tolist() == doc
    assert staged.cu_seqlens.tolist() == [0, 1, 64, 128, 193, 323, 326]
    assert staged.chunk_indices.tolist() == chunks
    assert all(t.dtype == torch.int64 for t in (staged.positions, staged.doc_ids, staged.cu_seqlens))
    for t in (staged.positions, staged.doc_ids, staged.cu_seqlens, staged.chunk_indices):
        base = staged.host.untyped_storage().data_ptr()          # one buffer (a CUDA one is 512 B aligned)
        assert t.untyped_storage().data_ptr() == base
        assert t.is_contiguous() and (t.data_ptr() - base) % 128 == 0   # segments on 128 B boundaries
    mask = block_causal_mask(row, torch.device("cpu"), "sdpa", torch.float32, staged.doc_ids)
    assert torch.equal(mask, block_causal_mask(row, torch.device("cpu"), "sdpa", torch.float32))
    assert stage_row(row, torch.device("cpu")).chunk_indices is None


def test_kernel_choice_on_cpu(bundle, caplog):
    if bundle.family != "qwen3.5":
        with TargetRunner(bundle, [1], topk=0, linear_attn_kernels="fla") as runner:   # no GDN: nothing to do
            assert "linear_attention" not in runner.kernel_paths
        return
    with pytest.raises(RuntimeFailure, match="CUDA"):
        TargetRunner(bundle, [1], topk=0, linear_attn_kernels="fla")
    with pytest.raises(UsageError):
        TargetRunner(bundle, [1], topk=0, linear_attn_kernels="triton")
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        with TargetRunner(bundle, [1], topk=0, linear_attn_kernels="auto") as runner:
            assert runner.linear_path == "torch"
            assert runner.kernel_paths["linear_attention"].startswith("torch")
    assert any("linear_attention layers: torch" in r.getMessage() for r in caplog.records)
    # FLA is never installed on the CPU machine: asking for it fails loudly, saying how to get it,
    # and transformers' own GDN rule is seen to be its PyTorch fallback.
    from dflash_pipe.target.gdn_packing import find_gdn_modules
    from dflash_pipe.target.kernels import hf_linear_attn_impl, import_fla

    with pytest.raises(RuntimeFailure, match="flash-linear-attention"):
        import_fla()
    assert hf_linear_attn_impl(find_gdn_modules(bundle.model)[0][1]) == "torch"


def test_close_restores_plain_model(bundle, docs_ids):
    doc = torch.tensor(docs_ids[0])
    before = standalone_features(bundle, doc, [1]).hidden_TD
    modules = list(bundle.model.modules())
    hooks_before = [len(m._forward_hooks) for m in modules]     # transformers keeps hooks of its own
    runner = TargetRunner(bundle, [1, bundle.num_layers - 1], topk=0, linear_attn_kernels="torch")
    assert sum(len(m._forward_hooks) for m in modules) == sum(hooks_before) + 2
    runner.close()
    assert [len(m._forward_hooks) for m in modules] == hooks_before
    for layer in bundle.model.base_model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            assert not any(k == "forward" or k.startswith("_dflash") for k in vars(mixer))   # patch gone
    assert torch.equal(standalone_features(bundle, doc, [1]).hidden_TD, before)
    with pytest.raises(UsageError):
        runner.run(doc, [doc.numel()])


def test_run_input_validation(bundle):
    with TargetRunner(bundle, [1], topk=0, linear_attn_kernels="torch") as runner:
        with pytest.raises(UsageError, match="sum to"):
            runner.run(torch.arange(10), [4, 5])
        with pytest.raises(UsageError, match="positive"):
            runner.run(torch.arange(10), [10, 0])
        with pytest.raises(ValidationError, match="position 3"):
            runner.run(torch.tensor([1, 2, 3, bundle.vocab_size, 4]), [5])
        with pytest.raises(UsageError, match="1-D"):
            runner.run(torch.arange(10)[None], [10])
    with pytest.raises(UsageError):
        TargetRunner(bundle, [bundle.num_layers], topk=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_layout_equals_standalone_and_packed(bundle, docs_ids, attn, model_cache):
    """--attention-layout padded: one right-padded row per document, plain causal attention; every document's
    features and top-k equal its standalone forward's, as the packed row's do (and a GDN target is refused)."""
    if bundle.identity["model"] != "random:tiny-llama":
        with pytest.raises(UsageError, match="Gated DeltaNet") as err:
            TargetRunner(bundle, LAYERS, topk=8, linear_attn_kernels="torch", layout="padded")
        assert err.value.exit_code == 2
        return
    if attn != "sdpa":
        bundle = load_target(bundle.identity["model"], dtype="float32", model_cache_dir=model_cache,
                             attn_implementation=attn)
    ids, lens = _packed(docs_ids)
    with TargetRunner(bundle, LAYERS, topk=8, hidden_dtype=None, layout="padded") as runner:
        out = runner.run(ids, lens)
        one = runner.run(torch.tensor(docs_ids[1]), [len(docs_ids[1])])    # one document: the plain forward
    with TargetRunner(bundle, LAYERS, topk=8, hidden_dtype=None) as runner:
        packed = runner.run(ids, lens)
    assert out.hidden_TD.shape == packed.hidden_TD.shape
    assert _rel(out.hidden_TD, packed.hidden_TD) < 1e-5
    assert torch.equal(out.topk_ids_TK, packed.topk_ids_TK)
    start = 0
    for doc in docs_ids:
        ref = standalone_features(bundle, torch.tensor(doc), LAYERS, topk=8)
        assert _rel(out.hidden_TD[start:start + len(doc)], ref.hidden_TD) < 1e-5
        assert torch.equal(out.topk_ids_TK[start:start + len(doc)], ref.topk_ids_TK)
        start += len(doc)
    assert _rel(one.hidden_TD, standalone_features(bundle, torch.tensor(docs_ids[1]), LAYERS).hidden_TD) < 1e-5
    with pytest.raises(UsageError, match="--attention-layout"):
        TargetRunner(bundle, LAYERS, layout="ragged")
