"""The fused RoPE / SwiGLU kernels' gate on the CPU (target/fused_elementwise.py): never taken here (Triton is not
installed on CPU machines), so the engine keeps the PyTorch ops; the kernels themselves are GPU-tested
(tests/test_fused_elementwise_gpu.py)."""

from __future__ import annotations

import torch

from dflash_pipe.target import fused_elementwise as fe
from dflash_pipe.target.small_batch_ops import SILU_MODULES


def test_the_kernels_are_never_chosen_for_cpu_or_fp32_tensors_or_when_disabled(monkeypatch):
    for t in (torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 4)):
        assert not fe.supported(t)
    monkeypatch.setattr(fe, "ENABLED", False)
    assert not fe.supported(torch.zeros(2, 4, dtype=torch.bfloat16))


def test_the_swiglu_kernel_is_offered_for_both_silu_modules_only():
    from transformers.activations import ACT2FN

    assert type(ACT2FN["silu"]).__name__ in SILU_MODULES and type(torch.nn.SiLU()).__name__ in SILU_MODULES
    assert type(ACT2FN["gelu"]).__name__ not in SILU_MODULES
