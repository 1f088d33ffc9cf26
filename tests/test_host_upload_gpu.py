"""host_upload.PinnedRing on CUDA (`pytest -m gpu`): a pinned block is never rewritten while a copy out of it is
still queued, so uploads queued behind a long device kernel all arrive intact."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.target.host_upload import PinnedRing

pytestmark = pytest.mark.gpu


def test_uploads_behind_a_busy_device_arrive_intact_and_wait_for_their_block():
    dev = torch.device("cuda")
    ring = PinnedRing(slots=4, min_bytes=64)
    gen = torch.Generator().manual_seed(0)
    sent, got = [], []
    torch.cuda._sleep(200_000_000)                  # ~0.1 s of device work queued ahead of every copy
    for i in range(13):                             # wraps the 4 blocks three times
        t = torch.randint(-2**40, 2**40, (int(torch.randint(1, 3000, (1,), generator=gen)),), generator=gen)
        sent.append(t.clone())
        got.append(ring.upload(t, dev))
        t.zero_()                                   # the caller's tensor may change at once: the block holds a copy
    torch.cuda.synchronize()
    assert all(torch.equal(a, b.cpu()) for a, b in zip(sent, got))
    assert ring.waits >= 1                          # the 5th upload found block 0's copy still behind the sleep


def test_ring_keeps_dtype_and_shape_and_grows_its_blocks():
    dev = torch.device("cuda")
    ring = PinnedRing(slots=2, min_bytes=16)
    for t in (torch.arange(6, dtype=torch.int32).view(2, 3), torch.rand(5000), torch.tensor([True, False]),
              torch.zeros(0, dtype=torch.long)):
        out = ring.upload(t, dev)
        assert out.dtype == t.dtype and out.shape == t.shape and out.device.type == "cuda"
        assert torch.equal(out.cpu(), t)

