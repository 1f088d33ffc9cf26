"""The target side of speculative decoding: prefill, verify a draft in one forward, roll back.

`TargetVerifier` owns the target's KV cache for one generation (batch 1) and, while it runs,
forward hooks that copy the outputs of the drafter's `target_layer_ids` into one growing
feature buffer (the same convention as the feature cache: layer output = HF
``hidden_states[id + 1]``; for the last layer the final norm's output, exactly like
`dflash_pipe.target.runner`). Row t of the buffer holds the features of token t.

Invariant between steps, with p = index of the last committed token:
  * the KV cache holds tokens 0..p-1 (the last committed token has not been fed yet);
  * feature rows 0..p-1 are final; rows >= p hold stale values of rejected positions or zeros
    (always finite, so a masked attention over them stays exact).
`verify([tokens[p], d_1..d_k])` feeds those k+1 tokens at positions p..p+k and returns the
target's argmax after each of them; `commit(a)` keeps the first a+1 of them (the last
committed token and the a accepted drafts) and crops the rest out of the cache.

Cache modes:
  * ``crop`` (attention-only targets, e.g. Llama/SmolLM2, Qwen3): HF DynamicCache, cropped with
    a negative count (the form both transformers 5.17 and 5.24 accept).
  * ``rollback`` (the default for targets with Gated DeltaNet layers, e.g. Qwen3.5/3.6): the HF
    cache, whose linear-attention states cannot be cropped, so `verify` first snapshots every
    linear layer's conv + recurrent state (`recurrent_state.py`); `commit` with a rejected draft
    restores the snapshot, crops the attention layers by the whole block and re-feeds the
    accepted tokens (one more forward of accepted + 1 tokens, without feature capture: the
    verify already wrote those rows from the same prefix). A fully accepted block needs neither.
    A step costs O(block), not O(sequence).
  * ``recompute`` (reference for recurrent targets): no cache, every verify re-runs the whole
    sequence. Tokens and acceptance are exact; wall-clock numbers are not representative of a
    serving engine, so the report omits speedups in this mode.

The transformers API moved between the two versions we support: the forward's cache argument
is ``past_key_values`` on 5.17 and ``cache`` on 5.24 (the old name still works there, with a
deprecation warning). `cache_kwarg_name` picks the name from the forward's signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from ..errors import UsageError
from ..target.runner_utils import decoder_layers, final_norm, layer_kinds
from .recurrent_state import RecurrentSnapshot, crop_attention

CACHE_MODES = ("auto", "crop", "rollback", "recompute")
CACHED_MODES = ("crop", "rollback")


def cache_kwarg_name(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_dynamic_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # very old signature without config
        return DynamicCache()


def resolve_cache_mode(model: torch.nn.Module, mode: str) -> str:
    """'auto' -> 'crop' for attention-only targets, 'rollback' when any layer is recurrent."""
    if mode not in CACHE_MODES:
        raise UsageError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    recurrent = "linear_attention" in layer_kinds(model)
    if mode == "crop" and recurrent:
        raise UsageError("this target has linear-attention (Gated DeltaNet) layers, whose recurrent state a "
                         "KV-cache crop cannot roll back", "use cache mode 'rollback' (or 'auto')")
    if mode == "rollback" and not recurrent:
        raise UsageError("cache mode 'rollback' is for targets with linear-attention layers; this one has none",
                         "use cache mode 'crop' (or 'auto')")
    if mode == "auto":
        return "rollback" if recurrent else "crop"
    return mode


class FeatureCapture:
    """Forward hooks writing the chosen layers' outputs into rows [offset, offset + T) of a buffer."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], num_layers: int, hidden_size: int):
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.buffer: torch.Tensor | None = None   # [max_tokens, n * H]
        self.offset = 0
        self.active = False                          # armed only during the owner's own forwards
        layers = decoder_layers(model)
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad:
            raise UsageError(f"drafter target layer {bad[0]} is outside the target's layers 0..{num_layers - 1}",
                             "the drafter was trained for another target")
        self._handles = []
        for j, layer_id in enumerate(self.layer_ids):
            module = final_norm(model) if layer_id == num_layers - 1 else None
            module = module if module is not None else layers[layer_id]
            self._handles.append(module.register_forward_hook(self._hook(j)))

    def _hook(self, j: int):
        H = self.hidden_size

        def hook(_mod, _inp, out):
            if not self.active or self.buffer is None:
                return
            h = out[0] if isinstance(out, (tuple, list)) else out
            h = h[0]                                            # batch 1: [T, H]
            end = self.offset + h.shape[0]
            if end > self.buffer.shape[0]:
                raise UsageError(f"feature buffer of {self.buffer.shape[0]} rows is too small for {end} tokens")
            self.buffer[self.offset:end, j * H:(j + 1) * H].copy_(h)

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.buffer = None


class TargetVerifier:
    """Greedy target for one speculative generation (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, cache_mode: str = "auto", capture: FeatureCapture | None = None):
        self.model = model
        self.mode = resolve_cache_mode(model, cache_mode)
        self.capture = capture
        self.cache_kw = cache_kwarg_name(model)
        self.device = next(model.parameters()).device
        self.cache = None
        self.tokens: list[int] = []       # committed tokens
        self.forwards = 0                 # prefill + verify forwards
        self.refeeds = 0                  # rollback re-feed forwards (rejected drafts on a recurrent target)
        self._pending: list[int] = []     # tokens fed by the last verify
        self.snapshot = RecurrentSnapshot() if self.mode == "rollback" else None

    def _forward(self, ids: list[int], offset: int, keep_logits: int, capture: bool = True) -> torch.Tensor:
        """Forward `ids` (positions offset..); returns argmax ids of the last `keep_logits` positions."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        cached = self.mode in CACHED_MODES
        kwargs = {"use_cache": cached, "logits_to_keep": keep_logits}
        if cached:
            kwargs[self.cache_kw] = self.cache
        if self.capture is not None and capture:
            self.capture.offset, self.capture.active = offset, True
        try:
            out = self.model(input_ids=x, **kwargs)
        finally:
            if self.capture is not None:
                self.capture.active = False
        return out.logits[0, -keep_logits:].argmax(dim=-1)

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], feature_rows: int = 0) -> int:
        """Run the prompt; returns the target's first token (committed)."""
        if not prompt_ids:
            raise UsageError("cannot generate from an empty prompt")
        self.tokens = [int(t) for t in prompt_ids]
        self.forwards = self.refeeds = 0
        self.cache = new_dynamic_cache(self.model) if self.mode in CACHED_MODES else None
        if self.snapshot is not None:
            self.snapshot.reset()
        if self.capture is not None:
            width = len(self.capture.layer_ids) * self.capture.hidden_size
            dtype = next(self.model.parameters()).dtype
            self.capture.buffer = torch.zeros((max(feature_rows, len(self.tokens) + 1), width), dtype=dtype,
                                              device=self.device)
        first = int(self._forward(self.tokens, 0, 1)[-1])
        self.forwards += 1
        self.tokens.append(first)
        return first

    @torch.inference_mode()
    def verify(self, drafts: Sequence[int]) -> list[int]:
        """Feed [last committed token, *drafts]; the target's greedy token after each of them."""
        p = len(self.tokens) - 1
        fed = [self.tokens[p]] + [int(d) for d in drafts]
        if self.snapshot is not None:
            self.snapshot.save(self.cache)
        if self.mode in CACHED_MODES:
            argmax = self._forward(fed, p, len(fed))
        else:
            argmax = self._forward(self.tokens[:p] + fed, 0, len(fed))
        self.forwards += 1
        self._pending = fed
        return [int(t) for t in argmax.tolist()]

    @torch.inference_mode()
    def commit(self, accepted: int, bonus: int) -> None:
        """Keep the last token + `accepted` drafts of the last verify, then append `bonus`."""
        fed = self._pending
        if not 0 <= accepted < len(fed):
            raise UsageError(f"commit: accepted {accepted} of {len(fed) - 1} drafts")
        drop = len(fed) - 1 - accepted
        if self.mode == "crop" and drop:
            self.cache.crop(-drop)
        elif self.mode == "rollback" and drop:
            self._roll_back(fed, accepted)
        self.tokens.extend(fed[1:1 + accepted])
        self.tokens.append(int(bonus))
        self._pending = []

    def _roll_back(self, fed: list[int], accepted: int) -> None:
        """Cache back to before the verify (snapshot + attention crop), then feed the kept tokens again."""
        self.snapshot.restore(self.cache)
        crop_attention(self.cache, len(fed))
        self._forward(fed[:1 + accepted], len(self.tokens) - 1, 1, capture=False)
        self.refeeds += 1

    def close(self) -> None:
        """Remove the capture hooks and drop the cache (the model is a plain HF model again)."""
        if self.capture is not None:
            self.capture.close()
        self.cache = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def has_features(self) -> bool:
        return self.capture is not None

    def features(self) -> torch.Tensor:
        """The feature buffer (rows 0..p-1 final, p = len(tokens) - 1)."""
        if self.capture is None or self.capture.buffer is None:
            raise UsageError("this verifier captures no features")
        return self.capture.buffer


@torch.inference_mode()
def greedy_generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_ids: Sequence[int]) -> list[int]:
    """Plain target-only greedy decoding with a KV cache, one token per forward (the baseline)."""
    device = next(model.parameters()).device
    cache, kw = new_dynamic_cache(model), cache_kwarg_name(model)
    eos = set(int(e) for e in eos_ids)
    out: list[int] = []
    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    while len(out) < max_new_tokens:
        logits = model(input_ids=x, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        x = torch.tensor([[token]], dtype=torch.long, device=device)
    return out
