"""host_upload (CPU): host_long against torch.tensor (the same values, dtype and errors); upload's refusal during
CUDA graph capture."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_pipe.target.host_upload import host_long, upload


def test_host_long_equals_torch_tensor_on_lists_ranges_tuples_and_bools():
    rng = random.Random(0)
    lists = [[rng.randrange(-2**62, 2**62) for _ in range(n)] for n in (1, 7, 8192)]
    for values in lists + [range(5, 50, 3), (1, 2, 3), [True, False, 3], [2**63 - 1, -2**63]]:
        got = host_long(values)
        want = torch.tensor(list(values), dtype=torch.long)
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want)


def test_host_long_of_nothing_and_of_a_tensor():
    assert host_long([]).shape == (0,) and host_long([]).dtype == torch.long
    t = torch.tensor([1, 2], dtype=torch.int32)
    assert host_long(t).dtype == torch.long and torch.equal(host_long(t), t.long())


def test_host_long_raises_what_torch_raises_on_bad_values():
    for bad in ([2**64], ["a"]):
        with pytest.raises(ValueError) as torchs:
            torch.tensor(bad, dtype=torch.long)
        with pytest.raises(ValueError) as ours:
            host_long(bad)
        assert str(ours.value) == str(torchs.value)


def test_upload_on_the_cpu_keeps_a_tensor_and_converts_a_list():
    t = torch.tensor([[1.5, 2.0]])
    assert upload(t, torch.device("cpu")) is t or torch.equal(upload(t, torch.device("cpu")), t)
    got = upload([4, 5, 6], torch.device("cpu"))
    assert got.dtype == torch.long and got.tolist() == [4, 5, 6]


def test_an_upload_during_graph_capture_is_refused(monkeypatch):
    """A captured copy would read the pinned block at every replay, after the allocator handed it out again."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capture"):
        upload(torch.arange(4), torch.device("cuda"))
