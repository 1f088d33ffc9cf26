"""The rollback's re-feed without a forward: advance only the Gated DeltaNet states (`refeed="states"`).

After a rejected draft the rollback restores the recurrent snapshot and must bring every linear
layer's conv + delta-rule state to "after the accepted tokens". The plain way (`refeed="forward"`)
re-runs the whole model on those accepted + 1 tokens: a second full forward per rejected step, as
costly as the verify itself (2026-12-02 H200, 27B shape, bf16: 380 ms a rejected step vs 170 ms a
fully accepted one).

But the verify already computed, per GDN layer, the inputs those tokens need: causal layers make
token j's hidden state depend on tokens <= j only, so the verify's in_proj_qkv / in_proj_a /
in_proj_b outputs of the first accepted + 1 positions are what a re-feed would compute again (up
to GEMM rounding at another row count). `GDNStateRefeed` keeps those three outputs of the last
verify (forward hooks, armed only during the verify) and, on rollback, runs per GDN layer just the
conv-state update + causal conv + the delta-rule kernel over the kept positions, with the kernels
the model's own module uses (FLA on a GPU, transformers' torch reference on the CPU; T = 1 takes
the decode kernels, as transformers does). The attention layers keep the verify's keys/values of
the accepted positions (crop only the rejected ones); the MLPs, the attention and the lm_head are
not run again.

Mirrors transformers' Qwen3_5GatedDeltaNet.forward (5.17-5.25): conv over [state | qkv] then the
last T outputs, SiLU, split q/k/v, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), q/k
heads repeated to the value heads (an exact copy: 5.17 does it in the layer, 5.24 in the kernel),
L2-norm inside the kernel. Anything missing raises at construction: use refeed="forward".
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..target.gdn_packing import find_gdn_modules
from .recurrent_state import advance_count

_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
            "torch_recurrent_gated_delta_rule")
_ATTRS = ("in_proj_qkv", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "key_dim", "value_dim",
          "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads", "layer_idx")
_HINT = "use the rollback's forward re-feed (refeed='forward')"


class GDNStateRefeed:
    """Captures the verify's GDN projections; `advance(cache, n)` feeds their first n positions to the states."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [m for _, m in find_gdn_modules(model)]
        if not self.modules:
            raise UsageError("state re-feed on a target without Gated DeltaNet layers", _HINT)
        mod0 = self.modules[0]
        self.kernels = sys.modules[type(mod0).__module__]
        missing = [k for k in _KERNELS if not callable(getattr(self.kernels, k, None))]
        missing += [a for a in _ATTRS if not hasattr(mod0, a)]
        if missing:
            raise UsageError(f"{type(mod0).__name__} lacks {missing}: not the Qwen3.5 GDN layout this re-feed mirrors",
                             _HINT)
        self.active = False
        self.saved: dict[int, dict[str, torch.Tensor]] = {}
        self._handles = []
        for mod in self.modules:
            for name in ("in_proj_qkv", "in_proj_a", "in_proj_b"):
                self._handles.append(getattr(mod, name).register_forward_hook(self._hook(mod.layer_idx, name)))

    def _hook(self, layer: int, name: str):
        def hook(_mod, _inp, out):
            if self.active:
                self.saved.setdefault(layer, {})[name] = out
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self.saved = [], {}

    @torch.inference_mode()
    def advance(self, cache, n: int) -> None:
        """Every GDN layer's state (already restored to before the verify) advanced over n kept positions."""
        for mod in self.modules:
            saved = self.saved.get(mod.layer_idx)
            if saved is None or len(saved) != 3:
                raise UsageError(f"layer {mod.layer_idx}: no captured verify projections to re-feed from", _HINT)
            layer = cache.layers[mod.layer_idx]
            self._advance_layer(mod, layer.conv_states[0], layer.recurrent_states[0],
                                *(saved[k][:, :n] for k in ("in_proj_qkv", "in_proj_a", "in_proj_b")))
            advance_count(cache, mod.layer_idx, n)

    def _advance_layer(self, mod, conv_state, rec_state, qkv, a, b) -> None:
        k = self.kernels
        T = qkv.shape[1]
        x = qkv.transpose(1, 2)                                              # [1, C, T]
        weight, act = mod.conv1d.weight.squeeze(1), getattr(mod, "activation", "silu")
        if T == 1:
            x = k.causal_conv1d_update(x, conv_state, weight, mod.conv1d.bias, act)   # updates conv_state
        else:
            full = torch.cat([conv_state, x], dim=-1)
            conv_state.copy_(full[..., -conv_state.shape[-1]:])
            x = k.causal_conv1d_fn(full, weight, mod.conv1d.bias, activation=act)[:, :, -T:]
        x = x.transpose(1, 2)
        q, key, v = torch.split(x, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        q = q.reshape(1, T, -1, mod.head_k_dim)
        key = key.reshape(1, T, -1, mod.head_k_dim)
        v = v.reshape(1, T, -1, mod.head_v_dim)
        beta = b.sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
        groups = mod.num_v_heads // mod.num_k_heads
        if groups > 1:
            q, key = q.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
        rule = k.torch_recurrent_gated_delta_rule if T == 1 else k.torch_chunk_gated_delta_rule
        _, final = rule(q, key, v, g=g, beta=beta, initial_state=rec_state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        rec_state.copy_(final)
