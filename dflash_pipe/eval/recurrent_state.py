"""Snapshot and restore of a hybrid target's recurrent state (the `rollback` cache mode's one seam).

transformers 5.17-5.x keep a Qwen3.5/3.6 (Gated DeltaNet + full attention) model's cache in one
`DynamicCache` whose ``layers[i]`` is, per decoder layer:
  * a ``LinearAttentionLayer`` for a linear-attention layer: ``conv_states[0]`` (the depthwise
    conv's last `kernel` inputs, [1, channels, kernel]) and ``recurrent_states[0]`` (the delta-rule
    state, [1, heads, d_k, d_v]); both are updated in place by every forward (copy_, so their
    addresses stay static) and have no sequence dimension, so they cannot be cropped;
  * a ``DynamicLayer`` for a full-attention layer: ``keys`` / ``values`` that ``crop(-n)`` shortens.
From 5.25 a linear layer also counts the tokens it has seen (``cumulative_length_linear``, a 0-d tensor
that ``get_seq_length`` returns, so the model's positions come from it when layer 0 is linear): the
snapshot saves and restores it with the states, and a state-only re-feed advances it (`advance_count`).
This module is the only place that reads those attributes, so a transformers change lands here.

`RecurrentSnapshot.save()` copies every linear layer's two states into buffers allocated once per
generation; `restore()` copies them back. Together with cropping the attention layers by the
whole verified block (`crop_attention`) that puts the cache exactly where it was before the
verify forward, and the caller re-feeds the accepted tokens: O(block) per step, not O(sequence).
"""

from __future__ import annotations

import torch

from ..errors import UsageError

_HINT = "this transformers version keeps its hybrid cache differently; use cache mode 'recompute'"


def _is_linear(layer) -> bool:
    return isinstance(getattr(layer, "conv_states", None), dict) and isinstance(
        getattr(layer, "recurrent_states", None), dict)


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UsageError(f"the target's cache ({type(cache).__name__}) has no per-layer list", _HINT)
    return list(layers)


def crop_attention(cache, tokens: int) -> None:
    """Drop the last `tokens` positions from every attention layer (linear layers have no positions)."""
    if tokens <= 0:
        return
    for layer in _layers(cache):
        if not _is_linear(layer):
            layer.crop(-tokens)


def _counter(layer) -> torch.Tensor | None:
    """A linear layer's token counter (transformers >= 5.25; None before)."""
    c = getattr(layer, "cumulative_length_linear", None)
    return c if isinstance(c, torch.Tensor) else None


def _counters(cache) -> list[torch.Tensor]:
    return [c for layer in _layers(cache) if _is_linear(layer) and (c := _counter(layer)) is not None]


def advance_count(cache, layer_idx: int, tokens: int) -> None:
    """Count `tokens` more seen by linear layer `layer_idx` (a re-feed that bypasses the layer's forward)."""
    counter = _counter(_layers(cache)[layer_idx])
    if counter is not None:
        counter.add_(tokens)


def linear_states(cache) -> list[torch.Tensor]:
    """The live state tensors of every linear-attention layer, conv then recurrent, in layer order."""
    out = []
    for i, layer in enumerate(_layers(cache)):
        if not _is_linear(layer):
            continue
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name)
            for idx in sorted(states):
                if states[idx] is None:
                    raise UsageError(f"layer {i}: {name}[{idx}] is not initialised (no prefill yet?)", _HINT)
                out.append(states[idx])
    return out


class RecurrentSnapshot:
    """One saved copy of a cache's linear-attention states (module docstring)."""

    def __init__(self):
        self._buffers: list[torch.Tensor] | None = None
        self._counts: list[torch.Tensor] = []
        self.saved = False
        self.saves = 0
        self.restores = 0

    def reset(self) -> None:
        """A new generation: the next save allocates buffers for its cache."""
        self._buffers, self.saved = None, False

    def save(self, cache) -> None:
        live = linear_states(cache)
        if not live:
            raise UsageError("rollback mode on a target without linear-attention layers", "use cache mode 'crop'")
        if self._buffers is None or [b.shape for b in self._buffers] != [t.shape for t in live]:
            self._buffers = [torch.empty_like(t) for t in live]
        for buf, t in zip(self._buffers, live):
            buf.copy_(t)
        self._counts = [c.clone() for c in _counters(cache)]
        self.saved = True
        self.saves += 1

    def restore(self, cache) -> None:
        if not self.saved or self._buffers is None:
            raise UsageError("restore without a saved snapshot")
        live = linear_states(cache)
        if [b.shape for b in self._buffers] != [t.shape for t in live]:
            raise UsageError("the cache's recurrent states changed shape since the snapshot", _HINT)
        for buf, t in zip(self._buffers, live):
            t.copy_(buf)
        counters = _counters(cache)
        if len(counters) != len(self._counts):
            raise UsageError("the cache's linear-layer token counters changed since the snapshot", _HINT)
        for saved, c in zip(self._counts, counters):
            c.copy_(saved)
        self.restores += 1


def cache_tensors(cache) -> list[torch.Tensor]:
    """Everything the cache holds, in layer order: linear layers' conv + recurrent states, attention
    layers' keys + values (for comparing a rolled-back cache with a fresh prefill of the same tokens)."""
    out = []
    for layer in _layers(cache):
        if _is_linear(layer):
            out += [layer.conv_states[i] for i in sorted(layer.conv_states)]
            out += [layer.recurrent_states[i] for i in sorted(layer.recurrent_states)]
        else:
            out += [layer.keys, layer.values]
    return out
