"""GPU checks of the static-KV engine (`pytest -m gpu`): CUDA graphs == eager, exact vs HF, no host sync per step.

Random tiny-llama weights, synthetic token ids (no tokenizer, so no carried data is needed).
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend, TurnRequest
from dflash_pipe.eval.regen_sampling import Decoding
from dflash_pipe.target.loading import build_random_model
from dflash_pipe.target.static_forward import StaticKVEngine
from tests.eval_helpers import drain_backend, liven

pytestmark = pytest.mark.gpu
LENS = [5, 40, 17, 1, 33, 64, 9, 2]


def _model(dtype):
    m = build_random_model("tiny-llama", seed=0, device=torch.device("cuda"), dtype=dtype)
    return liven(m.eval().requires_grad_(False))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in LENS]


def _prefill(eng, prompts):
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    out = eng.forward(ids, torch.tensor([len(p) for p in prompts]), rows=list(range(len(prompts))), last_only=True)
    return out.logits.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_decode_equals_eager_decode(dtype):
    model = _model(dtype)
    prompts = _prompts()
    runs = {}
    for mode in ("on", "off"):
        eng = StaticKVEngine(model, len(prompts), 160, use_graphs=mode, kv_bucket=16)
        cur = _prefill(eng, prompts)[:, None]
        toks, logits = [], []
        for step in range(40):                                 # crosses several 16-token buckets
            live = torch.tensor([(r + step) % 5 != 0 for r in range(len(prompts))], device="cuda")
            out = eng.forward(cur, live.long())
            logits.append(out.logits[:, 0].float().clone())
            cur = torch.where(live[:, None], out.logits[:, 0].argmax(-1, keepdim=True), cur)
            toks.append(cur[:, 0].clone())
        runs[mode] = (torch.stack(toks), torch.stack(logits), [eng.length(r) for r in range(len(prompts))])
        if mode == "on":
            assert eng.graph_count >= 3
    (t_on, l_on, n_on), (t_off, l_off, n_off) = runs["on"], runs["off"]
    assert torch.equal(t_on, t_off) and n_on == n_off
    assert float((l_on - l_off).abs().max() / l_off.abs().max()) <= 1e-3


def test_engine_on_cuda_equals_the_hf_forward_in_fp32():
    model = _model(torch.float32)
    prompts = _prompts()
    eng = StaticKVEngine(model, len(prompts), 128, kv_bucket=32)
    cur = _prefill(eng, prompts)[:, None]
    seqs = [p + [int(t)] for p, t in zip(prompts, cur[:, 0])]
    for _ in range(6):
        out = eng.forward(cur)
        cur = out.logits[:, 0].argmax(-1, keepdim=True)
        for r, s in enumerate(seqs):
            with torch.inference_mode():
                ref = model(input_ids=torch.tensor([s], device="cuda"), use_cache=False).logits[0, -1]
            assert float((out.logits[r, 0] - ref).abs().max() / ref.abs().max()) <= 1e-4
            s.append(int(cur[r, 0]))


def test_decode_steps_do_not_sync_the_host():
    model = _model(torch.bfloat16)
    be = EngineBackend(model, [2], batch=8, max_len=256, max_new_tokens=64, dec=Decoding(temperature=0.8, top_p=0.9),
                       check_every=4)
    ready = [TurnRequest(None, p, key=i, order=i) for i, p in enumerate(_prompts())]
    be.launch(ready)                       # prefill + first steps: captures the graph of this bucket
    be.collect()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            be._decode()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert be.engine.graph_count >= 1


def test_tail_compaction_on_graphs_gives_the_same_answers():
    """Staggered prompts through 8 graphed slots, fp32: compacted tail (steps on 4, 2, 1 rows) == full width."""
    model = _model(torch.float32)
    runs = {}
    for compact in (False, True):
        be = EngineBackend(model, [], batch=8, max_len=160, max_new_tokens=24, dec=Decoding(), check_every=4,
                           compact=compact)
        be.min_width = 1
        incoming = [TurnRequest(None, p, key=i, order=i) for i, p in enumerate(_prompts() + _prompts()[:3])]
        ready, got, widths = [], {}, set()
        while incoming or ready or be.busy():
            if incoming:
                ready.append(incoming.pop(0))
            be.launch(ready)
            widths.add(be.width)
            for c in be.collect():
                got[c.request.order] = c.tokens
        runs[compact] = got
        assert (min(widths) == 1) == compact
    assert runs[True] == runs[False] and len(runs[True]) == 11


@pytest.mark.parametrize("attention", ["sdpa", "rows"])
def test_launches_with_refills_do_not_sync_the_host(attention):
    """Whole launches (refill prefills, tail compaction, decode steps) under sync-debug 'error' mode; a first
    pass over the same prompts runs each prefill shape eagerly, a second one captures the graphs (capturing syncs),
    the third one must not sync at all. Both decode attentions (padded SDPA, the per-row Triton kernel)."""
    model = _model(torch.bfloat16)
    be = EngineBackend(model, [2], batch=8, max_len=256, max_new_tokens=64, dec=Decoding(temperature=0.8, top_p=0.9),
                       check_every=4, attention=attention)
    be.engine.prefill_shapes.reuse_ratio = 1.0   # each call its own bucket shape: the same shapes in every pass
    for strict in (False, False, True):      # a prefill shape's graph is captured at its second call
        answers = drain_backend(be, _prompts() + _prompts()[:4], sync_each=True, strict=strict)
        assert len(answers) == 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_bucketed_prefill_equals_eager_and_padding_rows_never_touch_live_rows(dtype):
    """The same prefill calls (3 prompts -> 8 padded rows, the shape's first call eager, its second captured, the
    third replayed) on a graphed and an eager engine: the logits and the K/V written are equal, the live rows'
    K/V and every length are untouched by the padding rows, which write only into the scratch row."""
    model = _model(dtype)
    prompts = _prompts()
    groups = [([prompts[0], prompts[1], prompts[3]], [4, 0, 7]), ([prompts[2], prompts[4], prompts[6]], [1, 5, 2]),
              ([prompts[5], prompts[7], prompts[0]], [3, 6, 9])]          # all padded to (8 rows, 64 tokens)
    runs = {}
    for mode in ("on", "off"):
        eng = StaticKVEngine(model, 10, 160, use_graphs=mode, kv_bucket=16, bucketed_prefill=True,
                             prefill_layout="padded")
        logits, untouched = [], True
        for k, (ps, rows) in enumerate(groups):
            before = eng.k_cache[:, :10].clone(), eng.v_cache[:, :10].clone(), eng.lengths[:10].clone()
            logits.append(eng.prefill(ps, rows).float().clone())
            assert eng.last_prefill_shape == (8, 64)
            others = [r for r in range(10) if r not in rows]
            untouched &= bool(torch.equal(eng.k_cache[:, others], before[0][:, others])
                              and torch.equal(eng.v_cache[:, others], before[1][:, others])
                              and torch.equal(eng.lengths[others], before[2][others]))
        assert untouched and eng.length(10) == 0
        if mode == "on":
            assert eng.prefill_graph_count == 1 and eng.graph_count == 1
        runs[mode] = (torch.stack(logits), eng.k_cache.float().clone(), eng.v_cache.float().clone(),
                      [eng.length(r) for r in range(10)])
    (l_on, k_on, v_on, n_on), (l_off, k_off, v_off, n_off) = runs["on"], runs["off"]
    assert n_on == n_off == [len(prompts[1]), len(prompts[2]), len(prompts[6]), len(prompts[5]), len(prompts[0]),
                             len(prompts[4]), len(prompts[7]), len(prompts[3]), 0, len(prompts[0])]
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert float((l_on - l_off).abs().max() / l_off.abs().max()) <= tol
    for r, n in enumerate(n_on):                                  # the rows' real K/V (beyond is unused space)
        if n == 0:
            continue
        for a, b in ((k_on, k_off), (v_on, v_off)):
            assert float((a[:, r, :, :n] - b[:, r, :, :n]).abs().max()) <= tol * float(b.abs().max())
    assert torch.equal(l_on[2].argmax(-1), l_off[2].argmax(-1))   # the replayed call picks the same tokens


class _Conv:
    """A synthetic conversation: its turns' user tokens; `done` once the last turn is answered."""

    def __init__(self, i, turns):
        self.i, self.turns, self.k, self.done = i, turns, 0, False


def test_history_reuse_on_graphs_gives_the_same_answers_fp32():
    """regenerate --reuse-history on CUDA graphs (appending prefills graphed too), fp32: three-turn conversations
    through 8 slots, each later prompt = the previous prompt + its answer + a separator + the next user turn (so it
    extends the held row), answers equal to full prefills; the driver's order (answers recorded after the next
    launch) as in regenerate.py."""
    model = _model(torch.float32)
    g = torch.Generator().manual_seed(1)
    convs = [[torch.randint(3, 49152, (n,), generator=g).tolist() for n in (LENS[i], 7 + i, 20 - i)]
             for i in range(len(LENS))]
    runs, delta_calls = {}, 0
    for reuse in (False, True):
        be = EngineBackend(model, [], batch=8, max_len=400, max_new_tokens=12, dec=Decoding(), check_every=4,
                           reuse_history=reuse)
        states = [_Conv(i, t) for i, t in enumerate(convs)]
        ready = [TurnRequest(s, s.turns[0], key=s.i, order=s.i) for s in states]
        got, pending = {}, []
        while ready or be.busy() or pending:
            be.launch(ready)
            for c in pending:                               # recorded after the next launch, as the driver does
                s = c.request.state
                got[(s.i, s.k)] = c.tokens
                s.k += 1
                if s.k < len(s.turns):
                    ready.append(TurnRequest(s, c.request.prompt + c.tokens + [1] + s.turns[s.k], key=s.i, order=s.i))
                else:
                    s.done = True
            pending = be.collect()
        runs[reuse] = got
        if reuse:
            delta_calls = be.delta_prefills
            assert be.engine.prefill_graph_count > 0
    assert runs[True] == runs[False] and len(runs[True]) == 3 * len(LENS)
    assert delta_calls > 0
