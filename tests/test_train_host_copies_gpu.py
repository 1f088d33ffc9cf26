"""On the GPU the trainer's host tensors cross from pinned memory (a copy from pageable memory makes the stream
wait for all work queued before it): the loader's small per-batch tensors are pinned on its producer threads,
the block embeddings' anchor rows are gathered into pinned memory, and the blocks equal the CPU path's exactly."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.train.loader import BatchLoader
from dflash_pipe.train.cache_index import CacheIndex
from tests.test_train_host_copies import _head

pytestmark = pytest.mark.gpu


def test_block_embeds_on_the_gpu_equal_the_cpu_path(tmp_path):
    cpu, gpu = _head(tmp_path), _head(tmp_path, "cuda")
    tokens = torch.randint(0, cpu.embed_VH.shape[0], (512,))
    for dtype in (torch.float32, torch.bfloat16):
        got = gpu.block_embeds(tokens, 3, 16, dtype)
        assert got.is_cuda and torch.equal(got.cpu(), cpu.block_embeds(tokens, 3, 16, dtype))


def test_the_loaders_batch_tensors_are_pinned(tmp_path):
    _head(tmp_path)   # writes the cache
    loader = BatchLoader(CacheIndex(tmp_path / "cache"), rank=0, world=1, seed=0, context_tokens=96, num_anchors=8,
                         max_anchors_per_doc=4, block_size=4, shuffle_rows=1, workers=1, want_topk=True,
                         pin_memory=True)
    batch = next(loader.iterate(0, 0))
    assert {k: v.is_pinned() for k, v in batch.tensors().items()} == {k: True for k in batch.tensors()}
