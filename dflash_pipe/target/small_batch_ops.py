"""The static-KV engine's per-layer math at small batch: fused projections, few-query attention, chosen GEMMs.

`LayerOps(engine)` is built once per engine and used by `StaticKVEngine._compute`:

* **fused projections**: q|k|v as one weight [(H + 2 KVH) D, hidden] and gate|up as one [2 I, hidden]
  per layer, concatenated once; the HF modules' own `weight` (and `bias`) parameters are then
  replaced by views into the fused tensor, so memory is not doubled and the HF model computes what
  it computed before (same values; `fused_views_intact` checks it). A rebuilt engine reuses the
  fusion it finds. Moving the model (``.to``) after building an engine breaks the views; build
  engines after moving. Layers whose projections differ in dtype / device / input width, or
  modules that are not plain `nn.Linear`, keep their separate calls.
* **few-query attention** (fp32; other dtypes keep SDPA, whose softmax runs in fp32 whatever the
  input): with T <= 16 new tokens and B x KV-heads below the GPU's SM count,
  SDPA's memory-efficient fp32 kernel runs a handful of CTAs (~33 us a layer on the H200 whatever
  T); explicit math is cheaper there: ``baddbmm(mask bias, q, k^T, alpha=scale)`` -> softmax ->
  ``bmm(., v)`` on [B * KVH, G * T, kv] (query heads folded onto their KV head), the additive mask
  built once per forward. Large batches (regenerate's decode) keep SDPA.
* **linear layers**: every projection and the LM head go through `LinearChooser`
  (linear_choice.py): on CUDA the fastest formulation per (M, N, K) for M in `tune_rows` (the
  engine's default: 1 and 16 at max_batch 1, the eval; none otherwise), timed when the engine is
  built; `F.linear` for other M and on the CPU.
* **RMSNorm** (``norm``): `F.rms_norm` with the module's weight (``fused``; ``auto`` = fp32 models, and every
  model on CUDA, where it is one kernel, `aten::_fused_rms_norm`) instead of HF's module (``hf``): in bf16 HF
  runs seven kernels over fp32 copies of the activations (to fp32, pow, mean, add, rsqrt, mul, to bf16, then
  the weight's broadcast multiply, which cannot vectorize) and rounds twice; the fused op rounds once. In session
  12's profile of a 64 x 128 prefill call those kernels were ~25 % of its device time. **rotary**: `rope`, three
  kernels per tensor instead of five (the signed sine made once per forward); where q|k|v is one fused
  projection (no q / k norm), q and k are rotated together, as one [B, T, H + KVH, D] view of its output:
  three kernels a layer instead of six.

* **per-row-length attention** (``rows``; decode_attention.py, a Triton kernel): bf16 / fp16 on CUDA at
  large batch (B x KV-heads >= the SM count: regenerate's decode), each row reads only its own keys
  instead of the padded `kv_len` that SDPA reads for every row.

``attention`` = auto | sdpa | explicit | rows, ``linear`` = auto | linear, ``fused`` = True | False,
``norm`` = auto | fused | hf.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import UsageError
from . import decode_attention, fused_elementwise
from .linear_choice import CANDIDATES, LinearChooser, extra_for, tf32_on

log = logging.getLogger("dflash_pipe.target")

ATTENTION_MODES = ("auto", "sdpa", "explicit", "rows")
NORM_MODES = ("auto", "fused", "hf")
DEFAULT_SM_COUNT = 132          # the CPU has none; the same rule as an H200, so CPU tests run the GPU's choice
SILU_MODULES = ("SiLU", "SiLUActivation")   # torch's and transformers' SiLU modules (F.silu): fused_elementwise's


def few_query_bias(visible: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B * KVH, R, kv] (0 where visible, -inf elsewhere) from a boolean [B, 1, R, kv]."""
    B, _, R, S = visible.shape
    bias = torch.zeros((B, 1, R, S), dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias.expand(B, kv_heads, R, S).reshape(B * kv_heads, R, S)


def few_query_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, bias: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for q [B, KVH, R, D], keys / vals [B, KVH, S, D] -> [B, KVH, R, D]."""
    B, KVH, R, D = q.shape
    scores = torch.baddbmm(bias, q.reshape(B * KVH, R, D), keys.flatten(0, 1).transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), vals.flatten(0, 1)).view(B, KVH, R, D)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[-sin_1, sin_2] (halves of the last dim): with it, rotate_half(x) * sin == swap_halves(x) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` in three kernels (swap the halves, multiply, addcmul), not five."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


def _plain_linears(mods) -> bool:
    return all(type(m) is torch.nn.Linear for m in mods) and len({(m.weight.dtype, m.weight.device, m.in_features)
                                                                  for m in mods}) == 1


def fuse_linears(mods: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """One weight (and bias) for `mods` stacked on the output dim; the modules' parameters become views of it.
    Reuses an earlier fusion of the same modules if its views are intact. None when they cannot be fused."""
    if not _plain_linears(mods):
        return None
    sizes = [m.out_features for m in mods]
    prev = getattr(mods[0], "_dflash_fused", None)
    if prev is not None and fused_views_intact(mods, prev):
        return prev
    with torch.inference_mode(False), torch.no_grad():   # plain tensors even when built inside inference mode
        W = torch.cat([m.weight.detach() for m in mods], 0)
        has_bias = any(m.bias is not None for m in mods)
        b = (torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in mods])
             if has_bias else None)
        off = 0
        for m, n in zip(mods, sizes):
            m.weight = torch.nn.Parameter(W[off:off + n], requires_grad=m.weight.requires_grad)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(b[off:off + n], requires_grad=m.bias.requires_grad)
            off += n
    fused = (W, b, sizes)
    for m in mods:
        m._dflash_fused = fused                     # plain attribute: not a parameter, not in the state dict
    return fused


def fused_views_intact(mods, fused) -> bool:
    """True while every module's weight (and bias) is still the view of `fused` it was made."""
    W, b, sizes = fused
    off = 0
    for m, n in zip(mods, sizes):
        if m.weight.data_ptr() != W[off].data_ptr() or m.weight.shape[0] != n:
            return False
        if m.bias is not None and (b is None or m.bias.data_ptr() != b[off].data_ptr()):
            return False
        off += n
    return True


class ChosenLinear:
    """One weight with its chosen formulation per row count."""

    def __init__(self, W, b, chooser: LinearChooser, rows: Sequence[int], copies: int, shared: dict):
        self.W, self.b = W, b
        self.how: dict[int, tuple] = {}
        for m in rows:
            name = chooser.choose(W, b, m, copies)
            if name != "linear":
                key = (name, W.data_ptr())
                if key not in shared:
                    shared[key] = extra_for(name, W, b)
                self.how[m] = (CANDIDATES[name][0], shared[key])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        how = self.how.get(x2.shape[0])
        y = F.linear(x2, self.W, self.b) if how is None else how[0](x2, self.W, self.b, how[1])
        return y.view(*lead, y.shape[-1])


def choose_linear_forwards(module: torch.nn.Module, rows: Sequence[int], chooser: LinearChooser) -> int:
    """Route every plain `nn.Linear` inside `module` through its chosen formulation at `rows` rows (an instance
    `forward` over the module's own weight: inputs of other row counts run `F.linear`); returns how many.
    For a module used only by this process's eval (the drafter the eval loaded)."""
    lins = [m for m in module.modules() if type(m) is torch.nn.Linear]
    shapes: dict[tuple, int] = {}
    for m in lins:
        shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    shared: dict = {}
    for m in lins:
        m.forward = ChosenLinear(m.weight, m.bias, chooser, rows, shapes[tuple(m.weight.shape)], shared)
    return len(lins)


class LayerOps:
    """Per-engine fused weights and op choices (module docstring)."""

    def __init__(self, layers, lm_head, device: torch.device, dtype: torch.dtype, *, attention: str = "auto",
                 linear: str = "auto", fused: bool = True, tune_rows: Sequence[int] = (1, 16), norm: str = "auto"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        if norm not in NORM_MODES:
            raise ValueError(f"norm must be one of {NORM_MODES}, got {norm!r}")
        self.attention, self.dtype, self.device = attention, dtype, device
        if attention == "rows" and not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                                        and decode_attention.triton_available()):
            raise UsageError(f"attention 'rows' needs CUDA, Triton and a bf16 / fp16 target (here: {device.type}, "
                             f"{dtype})", "use attention 'auto'")
        self.sm_count = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                         else DEFAULT_SM_COUNT)
        self.chooser = LinearChooser(device, linear)
        self.fused_norm = hasattr(F, "rms_norm") and (
            norm == "fused" or (norm == "auto" and (dtype == torch.float32 or device.type == "cuda")))
        rows, n, shared = sorted(set(int(r) for r in tune_rows)), len(layers), {}
        self.qkv, self.o, self.gate_up, self.down, self.act = [], [], [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            f = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]) if fused else None
            self.qkv.append((ChosenLinear(f[0], f[1], self.chooser, rows, n, shared), f[2]) if f else None)
            self.o.append(ChosenLinear(attn.o_proj.weight, attn.o_proj.bias, self.chooser, rows, n, shared)
                          if _plain_linears([attn.o_proj]) else attn.o_proj)
            mlp_parts = all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            g = fuse_linears([mlp.gate_proj, mlp.up_proj]) if fused and mlp_parts else None
            self.gate_up.append((ChosenLinear(g[0], g[1], self.chooser, rows, n, shared), g[2]) if g else None)
            self.down.append(ChosenLinear(mlp.down_proj.weight, mlp.down_proj.bias, self.chooser, rows, n, shared)
                             if g and _plain_linears([mlp.down_proj]) else None)
            self.act.append(mlp.act_fn if g else None)
        self.head = (ChosenLinear(lm_head.weight, lm_head.bias, self.chooser, rows, 1, shared)
                     if _plain_linears([lm_head]) else lm_head)
        if self.chooser.active:
            log.info("engine linear layers: %d shapes timed in %.2f s (TF32 %s), weight copies %.1f MiB",
                     len(self.chooser.table), self.chooser.tuned_s, "ON: not exact fp32" if tf32_on() else "off",
                     self.chooser.copy_bytes / 2**20)

    def explicit_attention(self, batch: int, kv_heads: int) -> bool:
        """Explicit few-query math (not SDPA) for this batch: `attention` mode, or auto by B * KVH vs SMs."""
        if self.attention != "auto":
            return self.attention == "explicit"
        return self.dtype == torch.float32 and batch * kv_heads < self.sm_count

    def row_attention(self, batch: int, kv_heads: int, query_rows: int, head_dim: int) -> bool:
        """Per-row-length attention (decode_attention.py) for this call: `attention` mode, or auto where the kernel
        runs and the batch fills the GPU (B * KVH >= SMs)."""
        if self.attention in ("sdpa", "explicit"):
            return False
        if self.attention == "auto" and batch * kv_heads < self.sm_count:
            return False
        return decode_attention.supported(self.device, self.dtype, query_rows, head_dim)

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        eps, weight = getattr(module, "variance_epsilon", None), getattr(module, "weight", None)
        if not self.fused_norm or eps is None or weight is None or weight.dtype != x.dtype:
            return module(x)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def project_qkv(self, li: int, attn, h: torch.Tensor):
        """(q, k, v) of layer `li`, each [B, T, out]."""
        if self.qkv[li] is None:
            return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        qk, v = self.project_qk_v(li, h)
        return (*qk.split(self.qkv[li][1][:2], dim=-1), v)

    def project_qk_v(self, li: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q|k [B, T, (H + KVH) D], v [B, T, KVH D]) of layer `li`: views of the one fused projection's output,
        so that RoPE can rotate q and k in one pass; None when q|k|v is not fused."""
        fused = self.qkv[li]
        if fused is None:
            return None
        lin, sizes = fused
        return lin(h).split([sizes[0] + sizes[1], sizes[2]], dim=-1)

    def mlp(self, li: int, mlp, h: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up[li]
        if fused is None:
            return mlp(h)
        lin, sizes = fused
        gate_up = lin(h)
        if type(self.act[li]).__name__ in SILU_MODULES and fused_elementwise.supported(gate_up):
            x = fused_elementwise.silu_mul(gate_up, sizes[0])             # one kernel (fused_elementwise.py)
        else:
            gate, up = gate_up.split(sizes, dim=-1)
            x = self.act[li](gate) * up
        return self.down[li](x) if self.down[li] is not None else mlp.down_proj(x)
