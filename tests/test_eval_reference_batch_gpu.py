"""GPU: batched target-only references (CUDA graphs, continuous batching) equal batch-1 greedy, fp32 (`pytest -m gpu`).

Self-contained: the tiny-llama preset built on the GPU (no tokenizer), raw-id prompts of many lengths (prefill
buckets, KV buckets around 128), more prompts than slots so finished slots are refilled; stop tokens that end
some outputs early.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.engine_step import EngineTarget, engine_greedy_generate
from dflash_pipe.eval.reference_batch import ReferenceBatcher
from dflash_pipe.target.loading import build_random_model
from tests.eval_helpers import hf_greedy, liven

pytestmark = pytest.mark.gpu
VOCAB = 49152
NEW = 48


def test_graphed_batched_references_equal_batch1_greedy_fp32():
    device = torch.device("cuda")
    model = liven(build_random_model("tiny-llama", seed=0, device=device, dtype=torch.float32)).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 300, (40,), generator=g)]
    target = EngineTarget(model, (), max_len=512, limit=4096)
    plain = [engine_greedy_generate(target, p, NEW, [2]) for p in prompts]
    assert all(hf_greedy(model, p, NEW, [2]) == want for p, want in zip(prompts[:6], plain[:6]))
    stops = [plain[0][7], plain[1][NEW - 1], plain[2][0]]
    for eos in ([2], stops):
        want = plain if eos == [2] else [engine_greedy_generate(target, p, NEW, eos) for p in prompts]
        batcher = ReferenceBatcher(model, eos, NEW, limit=4096, batch=16)       # 40 prompts on 16 slots
        got = batcher.generate(prompts)
        assert batcher.backend.engine.use_graphs
        mismatches = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not mismatches, mismatches
        batcher.close()
    auto = ReferenceBatcher(model, [2], NEW, limit=4096)                        # auto batch: all 40 in one wave
    assert auto.generate(prompts) == plain and auto.backend.B == 40
