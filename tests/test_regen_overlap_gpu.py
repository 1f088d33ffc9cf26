"""regenerate's overlap mode on CUDA (`pytest -m gpu`): staged prefills on the side stream, the decode on the main
one, the early snapshot: the direct path's answers, no host sync in a launch, both streams in use.

Random tiny-llama weights (livened), synthetic token ids."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.eval.regen_backends import EngineBackend
from dflash_pipe.eval.regen_sampling import Decoding
from tests.eval_helpers import drain_backend
from tests.test_static_forward_gpu import _model

pytestmark = pytest.mark.gpu
EOS = list(range(2, 49152, 7))         # a seventh of the vocabulary ends an answer: answers end at many steps


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(k),), generator=g).tolist() for k in torch.randint(1, 90, (n,), generator=g)]


@pytest.mark.parametrize("dec", [Decoding(), Decoding(temperature=0.8, top_p=0.9, seed=2)], ids=["greedy", "sampled"])
def test_overlap_gives_the_direct_paths_answers_in_fp32(dec):
    """fp32, CUDA graphs, 48 prompts through 16 slots and 8 staging rows: the same answers as the direct path."""
    model = _model(torch.float32)
    prompts = _prompts(48)
    kw = dict(batch=16, max_len=256, max_new_tokens=40, dec=dec, check_every=4)
    direct = drain_backend(EngineBackend(model, EOS, **kw), prompts)
    be = EngineBackend(model, EOS, overlap=True, staging_rows=8, **kw)
    over = drain_backend(be, prompts)
    assert sorted(over) == list(range(48)) and over == direct
    st = be.stats()
    assert st["staged_rows"] >= 16 and st["staged_rows"] + st["prefill_rows"] == 48, st
    assert be.staging.stream != be.main and be.main != torch.cuda.current_stream()


def test_overlap_launches_do_not_sync_the_host():
    """bf16, per-row attention: two passes capture every graph the prompts need (the device is synchronized
    before each launch, so the same groups land in every pass and the shapes repeat), the third runs its
    launches under sync-debug 'error' mode: landing, the side stream's prefills and the snapshot's copy
    never make the host wait; collect waits for the snapshot alone."""
    model = _model(torch.bfloat16)
    be = EngineBackend(model, [2], batch=16, max_len=256, max_new_tokens=48, dec=Decoding(temperature=0.8, top_p=0.9),
                       check_every=4, overlap=True, staging_rows=8, attention="rows")
    be.engine.prefill_shapes.reuse_ratio = be.staging.engine.prefill_shapes.reuse_ratio = 1.0
    prompts = _prompts(40, seed=1)
    counts = [len(drain_backend(be, prompts, sync_each=True, strict=strict)) for strict in (False, False, True)]
    assert counts == [40, 40, 40]
    assert be.staging.landed >= 3 * 16
