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
from tests.eval_helpers import liven

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
