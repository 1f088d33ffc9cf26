"""Which kernels run the Gated DeltaNet (linear-attention) layers, decided loudly.

Two packed paths exist (see gdn_packing.py):

  * 'torch' - each document goes through the layer's own transformers forward separately:
    exact by construction, whatever kernel transformers resolved (the PyTorch reference on a
    CPU). Used on CPU and as the reference.
  * 'fla'   - one varlen call per layer: flash-linear-attention's `chunk_gated_delta_rule`
    and `causal_conv1d`, both given `cu_seqlens`, so the recurrent state and the conv window
    restart at every document boundary. CUDA only.

'auto' means 'fla' on CUDA when the model has GDN layers, else 'torch'. Asking for 'fla'
where it cannot run (no CUDA, FLA not importable, or transformers itself resolved its GDN
functions to the PyTorch fallback, so the HF reference forward would silently be ~10x slower
and numerically different) raises RuntimeFailure instead of degrading.

FLA facts (flash-linear-attention 0.6.0, package `fla`):
  chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
      output_final_state=False, use_qk_l2norm_in_kernel=False, ..., cu_seqlens=None,
      cu_seqlens_cpu=None, ...) -> (o [B,T,HV,V], final_state); q/k [B,T,H,K], g/beta [B,T,HV],
      B must be 1 with cu_seqlens.
  causal_conv1d(x [B,T,D], weight [D,W], bias=None, ..., activation=None, backend='triton',
      cu_seqlens=None, cu_seqlens_cpu=None, ...) -> (y [B,T,D], final_state); lives in
      fla.modules.causal_conv1d (0.6.0) and fla.modules.convolution (older releases, and an
      alias in 0.6.0).
  Both also take `chunk_indices` ([n_chunks, 2] (sequence, chunk) pairs for 64-token chunks).
  Without it they build it on the host from cu_seqlens_cpu (or .tolist() cu_seqlens) and copy
  it with a blocking `.to(cu_seqlens)`: one cudaStreamSynchronize per forward (cached across
  layers by identity of the cu_seqlens tensor). The runner passes it precomputed.
  Other host reads left in 0.6.0's forward: none on our path (intra-card CP, which would split
  sequences on the host, is off unless FLA_INTRACARD_CP=1; the FlashQLA backend is used only
  when the `flash_qla` package is installed, and ignores chunk_indices).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import RuntimeFailure, UsageError

log = logging.getLogger("dflash_pipe.target")

KERNEL_CHOICES = ("auto", "fla", "torch")
FLA_INSTALL_HINT = ("install the GPU extras: pip install 'flash-linear-attention==0.6.0' 'fla-core==0.6.0' "
                    "(triton comes with the CUDA torch build); never on a CPU-only machine")


@dataclass(frozen=True)
class FlaOps:
    chunk_gated_delta_rule: Callable
    causal_conv1d: Callable
    version: str
    takes_chunk_indices: bool = False     # both ops accept precomputed chunk_indices (0.6.0 does)


def _has_param(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def import_fla() -> FlaOps:
    """Import FLA's two varlen ops, or raise RuntimeFailure saying how to get them."""
    try:
        gdr = importlib.import_module("fla.ops.gated_delta_rule")
        try:
            conv_mod = importlib.import_module("fla.modules.causal_conv1d")
            conv = getattr(conv_mod, "causal_conv1d")
        except (ImportError, AttributeError):
            conv = getattr(importlib.import_module("fla.modules.convolution"), "causal_conv1d")
        fla = sys.modules.get("fla") or importlib.import_module("fla")
    except Exception as exc:  # ImportError, or a triton/CUDA error raised at import time
        raise RuntimeFailure(f"flash-linear-attention kernels were requested but cannot be imported: {exc!r}",
                             FLA_INSTALL_HINT) from exc
    if not callable(conv):
        raise RuntimeFailure("fla.modules.causal_conv1d.causal_conv1d is not a function in this FLA release",
                             FLA_INSTALL_HINT)
    takes = all(_has_param(f, "chunk_indices") for f in (gdr.chunk_gated_delta_rule, conv))
    return FlaOps(gdr.chunk_gated_delta_rule, conv, getattr(fla, "__version__", "unknown"), takes)


def _closure_var(fn: Callable, name: str):
    try:
        return inspect.getclosurevars(fn).nonlocals.get(name)
    except (TypeError, ValueError):
        return None


def _resolved_implementation(fn: Callable) -> Callable | None:
    """The implementation a transformers `use_kernel_func_from_hub_with_fallback` wrapper calls."""
    seen = 0
    while fn is not None and seen < 5:
        if isinstance(fn, torch.nn.Module):      # transformers >= 5.25 with `kernels`: a `Func` module wraps it
            fn = _closure_var(type(fn).forward, "func")
            seen += 1
            continue
        impl = _closure_var(fn, "implementation")
        if impl is not None:
            return impl
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def hf_linear_attn_impl(gdn_module: torch.nn.Module) -> str:
    """'fla' / 'torch' / 'unknown': what transformers' own GDN forward calls for the chunked rule."""
    modeling = sys.modules.get(type(gdn_module).__module__)
    fn = getattr(modeling, "torch_chunk_gated_delta_rule", None) if modeling else None
    if fn is None:
        return "unknown"
    impl = _resolved_implementation(fn)
    if impl is None:
        return "unknown"
    return "fla" if getattr(impl, "__module__", "").startswith("fla") else "torch"


def resolve_linear_attn_kernels(requested: str, device: torch.device, gdn_modules: list[torch.nn.Module]) -> str:
    """Return 'fla', 'torch' or 'none' (no GDN layers); raise where the request cannot be honoured."""
    if requested not in KERNEL_CHOICES:
        raise UsageError(f"linear_attn_kernels '{requested}' is not one of {', '.join(KERNEL_CHOICES)}")
    if not gdn_modules:
        return "none"
    choice = requested
    if requested == "auto":
        choice = "fla" if device.type == "cuda" else "torch"
    if choice == "fla":
        if device.type != "cuda":
            raise RuntimeFailure(f"FLA kernels need a CUDA device, the target is on {device}",
                                 "use --linear-attn-kernels torch (or auto) on a CPU")
        import_fla()
        hf_impl = hf_linear_attn_impl(gdn_modules[0])
        if hf_impl == "torch":
            raise RuntimeFailure(
                "transformers resolved its Gated DeltaNet functions to the PyTorch fallback although FLA "
                "is importable now (it decides once, when the model module is first imported)",
                "import fla before transformers' qwen3_5 modeling module (a fresh process with FLA installed "
                "does this), or pass --linear-attn-kernels torch")
    return choice


def eval_linear_attn_kernels(requested: str, device: torch.device, model: torch.nn.Module) -> str:
    """The Gated DeltaNet kernels an eval runs ('fla', 'torch' or 'none'), checked against --linear-attn-kernels.
    The eval decodes with the target's own forward, so it honours the request by refusing what that forward would
    not do (before session 28 the flag was accepted and ignored)."""
    from .gdn_packing import find_gdn_modules

    gdn = [m for _, m in find_gdn_modules(model)]
    choice = resolve_linear_attn_kernels(requested, device, gdn)
    if choice == "torch" and hf_linear_attn_impl(gdn[0]) == "fla":
        raise UsageError("--linear-attn-kernels torch: the eval decodes with the target's own forward, which "
                         "transformers bound to the FLA kernels in this process",
                         "use --linear-attn-kernels fla (or auto), or run where flash-linear-attention is not installed")
    return choice
