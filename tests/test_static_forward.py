"""StaticKVEngine: prefill + decode steps over rows of different lengths equal HF's full forward (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.errors import UsageError
from dflash_pipe.target.static_forward import StaticKVEngine, engine_support
from tests.eval_helpers import hf_greedy, liven


def _model(preset: str, **overrides):
    from dflash_pipe.target.loading import build_random_model

    model = build_random_model(preset, seed=0, device=torch.device("cpu"), dtype=torch.float32, **overrides)
    model.eval().requires_grad_(False)
    return liven(model)


@pytest.fixture(scope="module")
def llama():
    return _model("tiny-llama")


def _small(config_cls, **extra):
    from transformers import AutoModelForCausalLM

    cfg = config_cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():                         # biases (Qwen2's q/k/v) are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    return liven(model.eval().requires_grad_(False))


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3Config

    return _small(Qwen3Config, head_dim=16)          # q_norm / k_norm on the head dim


@pytest.fixture(scope="module")
def qwen2():
    from transformers import Qwen2Config

    return _small(Qwen2Config)                       # q/k/v biases


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _hf(model, seq, layer_ids=()):
    out = model(input_ids=torch.tensor([seq]), output_hidden_states=bool(layer_ids), use_cache=False)
    hid = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1) if layer_ids else None
    return out.logits[0], hid


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2"])
def test_prefill_then_decode_steps_equal_the_full_forward_for_rows_of_different_lengths(name, request):
    model = request.getfixturevalue(name)
    V = model.config.vocab_size
    L = model.config.num_hidden_layers
    layer_ids = (1, L - 1)                       # a middle layer and the last one (after the final norm)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 2)]
    eng = StaticKVEngine(model, max_batch=4, max_len=40, capture_layer_ids=layer_ids, kv_bucket=8)
    # batched right-padded prefill into rows 3, 0, 1 (a row subset, not in order)
    rows = [3, 0, 1]
    T = max(map(len, prompts))
    ids = torch.zeros((3, T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    out = eng.forward(ids, torch.tensor([len(p) for p in prompts]), rows=rows, last_only=True)
    seqs = [list(p) for p in prompts]
    for i, s in enumerate(seqs):
        ref, _ = _hf(model, s)
        assert _rel(out.logits[i], ref[-1]) <= 1e-5
    assert [eng.length(r) for r in rows] == [5, 11, 2]
    # decode: 4 steps of T=1 then a verify-style step of T=3 over rows 0..3 (row 2 empty: num_new 0)
    order = [1, 2, None, 0]                      # engine row -> index into seqs (row 2 unused)
    for step, T in enumerate([1, 1, 1, 1, 3]):
        new = torch.randint(0, V, (4, T), generator=g)
        num = torch.tensor([T if order[r] is not None else 0 for r in range(4)])
        out = eng.forward(new, num)
        for r in range(4):
            if order[r] is None:
                continue
            seqs[order[r]].extend(new[r].tolist())
            ref, hid = _hf(model, seqs[order[r]], layer_ids)
            assert _rel(out.logits[r], ref[-T:]) <= 1e-5, (name, step, r)
            assert _rel(out.hidden[r], hid[-T:]) <= 1e-5
    assert eng.length(2) == 0
    # roll back row 0 (seqs[1]) by 2 tokens, then feed a different continuation
    eng.truncate(0, len(seqs[1]) - 2)
    del seqs[1][-2:]
    new = torch.randint(0, V, (1, 2), generator=g)
    eng_out = eng.forward(torch.cat([new, torch.zeros((3, 2), dtype=torch.long)]), torch.tensor([2, 0, 0, 0]))
    seqs[1].extend(new[0].tolist())
    assert _rel(eng_out.logits[0], _hf(model, seqs[1])[0][-2:]) <= 1e-5
    eng.reset([0])
    assert eng.length(0) == 0 and eng.length(1) == len(seqs[2])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_engine_greedy_equals_hf_generate(name, request):
    model = request.getfixturevalue(name)
    eng = StaticKVEngine(model, max_batch=1, max_len=64)
    prompt = list(range(3, 12))
    out = eng.forward(torch.tensor([prompt]), last_only=True)
    toks = []
    for _ in range(20):
        t = int(out.logits[0].argmax())
        toks.append(t)
        out = eng.forward(torch.tensor([[t]]))
        out.logits = out.logits[:, 0]
    assert toks == hf_greedy(model, prompt, 20, [-1])
    assert len(set(toks)) > 3                     # a live model, not one repeated token


def test_hybrid_targets_are_not_supported():
    model = _model("tiny-qwen3.5")
    assert "layer types" in engine_support(model) or "model type" in engine_support(model)
    with pytest.raises(UsageError, match="static-KV engine cannot run"):
        StaticKVEngine(model, 1, 8)


def test_bucketed_prefill_equals_the_unpadded_forward_and_padding_rows_never_touch_live_rows(llama):
    """prefill() pads 3 prompts to (8 rows, 64 tokens): the logits and the K/V it writes equal an unpadded
    forward of the same prompts, and the rows already live (and every other row) keep their K/V and lengths."""
    model = llama
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(4)
    live = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 20)]
    new = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 40, 2)]
    eng = StaticKVEngine(model, max_batch=6, max_len=80, kv_bucket=8, bucketed_prefill=True)
    ref = StaticKVEngine(model, max_batch=6, max_len=80, kv_bucket=8)
    assert eng.k_cache.shape[1] == 7 and ref.k_cache.shape[1] == 6 and eng.scratch_row == 6
    eng.prefill(live, [2, 5])
    before = {r: (eng.k_cache[:, r].clone(), eng.v_cache[:, r].clone()) for r in range(6)}
    logits = eng.prefill(new, [4, 0, 1])
    assert eng.last_prefill_shape == (8, 64)
    T = max(map(len, new))
    ids = torch.zeros((3, T), dtype=torch.long)
    for i, p in enumerate(new):
        ids[i, :len(p)] = torch.tensor(p)
    want = ref.forward(ids, torch.tensor([len(p) for p in new]), rows=[4, 0, 1], last_only=True).logits
    assert logits.shape == (3, V) and _rel(logits, want) <= 1e-5
    for r, p in zip([4, 0, 1], new):
        n = len(p)
        assert _rel(eng.k_cache[:, r, :, :n], ref.k_cache[:, r, :, :n]) <= 1e-5
        assert _rel(eng.v_cache[:, r, :, :n], ref.v_cache[:, r, :, :n]) <= 1e-5
    for r in (2, 3, 5):                                            # live and empty rows: untouched, bit for bit
        assert torch.equal(eng.k_cache[:, r], before[r][0]) and torch.equal(eng.v_cache[:, r], before[r][1])
    assert [eng.length(r) for r in range(7)] == [40, 2, 7, 0, 5, 20, 0]   # the scratch row stays empty
    assert float(eng.k_cache[:, 6].abs().max()) > 0                # the 5 padding rows wrote there
    with pytest.raises(UsageError, match="one distinct row each"):
        eng.prefill([[1], [2]], [3, 3])
    with pytest.raises(UsageError, match="bucketed_prefill"):
        ref.prefill([[1]], [0])


def test_prefill_into_reset_rows_ignores_their_old_keys_and_equals_the_masked_append(llama):
    """Rows that held longer sequences, reset, then prefilled in one padded call: the fresh path (causal attention
    over the new tokens only) gives the logits and K/V of the masked append path of a fresh engine; a prefill into
    a row that is not empty appends (its old keys are attended to)."""
    model = llama
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    old = [torch.randint(0, V, (n,), generator=g).tolist() for n in (60, 45, 70)]
    new = [torch.randint(0, V, (n,), generator=g).tolist() for n in (33, 20, 9)]
    eng = StaticKVEngine(model, max_batch=4, max_len=80, kv_bucket=8, bucketed_prefill=True)
    eng.prefill(old, [0, 1, 2])
    eng.reset([0, 1, 2])
    got = eng.prefill(new, [2, 0, 1]).clone()
    ref = StaticKVEngine(model, max_batch=4, max_len=80, kv_bucket=8)
    T = max(map(len, new))
    ids = torch.zeros((3, T), dtype=torch.long)
    for i, p in enumerate(new):
        ids[i, :len(p)] = torch.tensor(p)
    want = ref.forward(ids, torch.tensor([len(p) for p in new]), rows=[2, 0, 1], last_only=True).logits
    assert _rel(got, want) <= 1e-5
    for r, p in zip([2, 0, 1], new):
        assert _rel(eng.k_cache[:, r, :, :len(p)], ref.k_cache[:, r, :, :len(p)]) <= 1e-5
    assert [eng.length(r) for r in range(3)] == [20, 9, 33]
    tail = [torch.randint(0, V, (n,), generator=g).tolist() for n in (18,)]
    appended = eng.prefill(tail, [1])                             # row 1 holds 9 tokens: an append
    ids = torch.tensor([new[2] + tail[0]])
    full = StaticKVEngine(model, max_batch=1, max_len=80, kv_bucket=8).forward(ids, last_only=True).logits
    assert _rel(appended, full) <= 1e-5 and eng.length(1) == 27


def test_fused_rms_norm_in_bf16_is_at_least_as_close_to_fp32_as_the_hf_module(monkeypatch):
    """norm 'fused' (F.rms_norm with the weight; the CUDA default) against norm 'hf' (HF's module), both bf16, over
    the same weights, against the fp32 engine: a prefill and decode steps over rows of different lengths. The fused
    norm's logits are no further from fp32 than HF's (x 1.1; on the CPU F.rms_norm rounds as HF does, on CUDA its
    fused kernel rounds once), every norm of the fused engine went through F.rms_norm (2 a layer + the final one
    a forward), none of the HF engine's did; in fp32 the two are equal to rounding."""
    import torch.nn.functional as F

    calls = []
    real = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref_model = _model("tiny-llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 30, 2, 19)]
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])

    def run(model, norm):
        calls.clear()
        eng = StaticKVEngine(model, len(prompts), 64, norm=norm)
        out = [eng.forward(ids, lens, rows=list(range(len(prompts))), last_only=True).logits.float()]
        cur = out[0].argmax(-1, keepdim=True)
        for _ in range(4):
            step = eng.forward(cur).logits[:, 0].float()
            out.append(step)
            cur = step.argmax(-1, keepdim=True)
        assert len(calls) == (5 * (2 * len(eng.layers) + 1) if eng.ops.fused_norm else 0), (norm, len(calls))
        return torch.stack(out), eng.ops.fused_norm

    import copy

    ref, fused32 = run(ref_model, "auto")
    hf32, _ = run(copy.deepcopy(ref_model), "hf")
    assert fused32 and float((ref - hf32).abs().max() / ref.abs().max()) < 1e-5
    bf = copy.deepcopy(ref_model).to(torch.bfloat16)
    hf, hf_on = run(bf, "hf")
    auto_cpu = StaticKVEngine(bf, 1, 16).ops.fused_norm           # auto on the CPU in bf16: HF's module
    fused, fused_on = run(bf, "fused")
    assert fused_on and not hf_on and not auto_cpu
    e_fused, e_hf = float((fused - ref).abs().mean()), float((hf - ref).abs().mean())
    assert e_fused <= 1.1 * e_hf, (e_fused, e_hf)


def test_capturable_forward_equals_forward_over_the_whole_cache_width(llama):
    """The kernels regenerate's lookup step captures (`capturable_forward`: rows 0..B-1, attention over the cache's
    whole width, no host bookkeeping) give `forward`'s logits and lengths on the same state; `widen_bounds` moves the
    host bounds to max_len, so a later attended length covers whatever the captured steps appended."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=g) for n in (7, 3, 12)]

    def engine():
        eng = StaticKVEngine(llama, max_batch=3, max_len=40, kv_bucket=8)
        for r, p in enumerate(prompts):
            eng.forward(p[None], rows=[r])
        return eng

    ids = torch.randint(3, 49152, (3, 4), generator=g)
    num = torch.tensor([4, 0, 4])
    a, b = engine(), engine()
    want = a.forward(ids, num).logits
    got = b.capturable_forward(ids, num).logits
    assert _rel(got, want) < 1e-5 and torch.equal(a.lengths, b.lengths)
    assert b._bound[:3] == [7, 3, 12]
    b.widen_bounds(2)
    assert b._bound[:3] == [40, 40, 12] and b.attended_length([0], 1) == 41
