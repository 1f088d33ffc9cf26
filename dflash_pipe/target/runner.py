"""Run the frozen target on one packed row and return per-document-exact features.

`TargetRunner.run(input_ids_T, doc_lens)` does one forward of batch 1 over T = sum(doc_lens)
tokens and returns, for every token, the outputs of the chosen decoder layers (concatenated
in `layer_ids` order) and the top-k of the next-token log-softmax. Each document's features
equal those of a standalone forward of that document alone, because:

  * positions restart per document and full-attention layers get an explicit block-diagonal
    causal mask (packing.py);
  * Gated DeltaNet layers restart their conv window and recurrent state per document
    (gdn_packing.py; FLA varlen kernels on CUDA, per-document forwards otherwise);
  * everything else (norms, MLPs, the LM head) is per token.

No host sync on CUDA (given pinned host input ids, as the extraction pipeline passes them): the
row's index tensors travel in one non-blocking copy of a pinned buffer (packing.stage_row), FLA
gets its chunk indices precomputed, and a row without a tensor mask hands the model a prebuilt
mask mapping where transformers accepts one (its own mask builder syncs). See
tests/test_target_sync_gpu.py.

Attention-only targets can instead run `layout="padded"`: one right-padded row per document, no mask, so the
attention is plain causal (SDPA's flash kernel, GQA included) over each document's own pairs instead of a
masked kernel over all T x T pairs of the packed row; padding sits after every real token, so causal attention
never lets a real token see it, and its outputs are dropped. Same features up to rounding (tests).

Layer outputs are captured by forward hooks writing straight into one preallocated
[T, n_layers * H] buffer (no `output_hidden_states=True`, which keeps every layer alive), and
the LM head runs on `logits_chunk` tokens at a time so full-vocab logits never exist for the
whole row. `standalone_features` is the independent reference: the plain HF forward with
`output_hidden_states=True`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UsageError, ValidationError
from .gdn_packing import PackedGDN, find_gdn_modules
from .kernels import import_fla, resolve_linear_attn_kernels
from .layers import validate_layer_ids
from .loading import TargetBundle
from .packing import FLA_CHUNK, block_causal_mask, flash_varlen_kwargs, make_packed_row, stage_row
from .runner_utils import (accepts_mask_mapping, chunked_topk_logprobs, decoder_layers, final_norm, layer_kinds,
                           text_backbone)

log = logging.getLogger("dflash_pipe.target")


@dataclass
class TargetOutput:
    hidden_TD: torch.Tensor                  # [T, n_layers * H], layer blocks in layer_ids order
    topk_ids_TK: torch.Tensor | None         # int32 [T, k]; row t predicts token t + 1
    topk_logprobs_TK: torch.Tensor | None    # fp16 [T, k], log-softmax values, descending


def _as_ids(input_ids_T, vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids_T)
    if ids.ndim != 1:
        raise UsageError(f"input_ids must be one packed row (1-D), got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise UsageError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        raise UsageError("input_ids is empty")
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValidationError(f"token id {int(ids[pos])} at position {pos} is outside the target's vocab "
                              f"[0, {vocab_size})", "the data was tokenized with another tokenizer")
    if device.type == "cuda" and ids.device.type == "cpu" and not ids.is_pinned():
        ids = ids.pin_memory()        # a pageable source would make the copy synchronous
    return ids.to(device=device, dtype=torch.long, non_blocking=True)


class TargetRunner:
    """Packed, hook-based feature extraction for one target (one runner per model at a time)."""

    def __init__(self, bundle: TargetBundle, layer_ids: Sequence[int], topk: int = 32,
                 linear_attn_kernels: str = "auto", logits_chunk: int = 2048,
                 hidden_dtype: torch.dtype | None = torch.bfloat16, layout: str = "packed"):
        self.bundle = bundle
        self.model = bundle.model
        self.layer_ids = validate_layer_ids(layer_ids, bundle.num_layers)
        if topk < 0 or topk > bundle.vocab_size:
            raise UsageError(f"topk must be in [0, {bundle.vocab_size}], got {topk}")
        if logits_chunk < 1:
            raise UsageError(f"logits_chunk must be >= 1, got {logits_chunk}")
        self.topk = topk
        self.logits_chunk = logits_chunk
        self.hidden_dtype = hidden_dtype or bundle.dtype
        self.device = bundle.device
        self.attn_impl = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        if self.attn_impl not in ("sdpa", "eager", "flash_attention_2"):
            raise UsageError(f"the target runs attn_implementation '{self.attn_impl}', which the packed runner "
                             "does not support", "load it with sdpa, eager or flash_attention_2")
        gdn = [m for _, m in find_gdn_modules(self.model)]
        self.linear_path = resolve_linear_attn_kernels(linear_attn_kernels, self.device, gdn)
        if layout not in ("packed", "padded"):
            raise UsageError(f"--attention-layout must be 'packed' or 'padded', got {layout!r}")
        if layout == "padded" and (gdn or self.attn_impl == "flash_attention_2"):
            why = ("has Gated DeltaNet layers, whose packed varlen path keeps documents apart already" if gdn else
                   "runs flash_attention_2, whose cu_seqlens path keeps documents apart already")
            raise UsageError(f"--attention-layout padded: the target {why}", "use --attention-layout packed")
        self.layout = layout
        self._valid: torch.Tensor | None = None   # padded layout: the real tokens' rows in the [n * L] batch
        self._gdn = None
        if self.linear_path != "none":
            self._gdn = PackedGDN(self.model, self.linear_path,
                                  import_fla() if self.linear_path == "fla" else None)
        self.kernel_paths = self._describe_kernels()
        for kind, path in self.kernel_paths.items():
            log.info("target %s layers: %s", kind, path)
        self._buffer: torch.Tensor | None = None
        self._staged = None            # the last row's DeviceRow: keeps its pinned source alive
        # A one-document row needs no tensor mask; where the model takes a {layer_type: mask} dict,
        # pass {type: None} so transformers' mask builder (a host sync) is skipped. Not for eager
        # attention: there a None mask means no causal mask at all.
        backbone = text_backbone(self.model)
        self._mask_mapping = (dict.fromkeys(set(backbone.config.layer_types))
                              if self.attn_impl != "eager" and accepts_mask_mapping(backbone) else None)
        self._hooks = self._install_hooks()

    def _describe_kernels(self) -> dict[str, str]:
        kinds = layer_kinds(self.model)
        out = {}
        if "full_attention" in kinds and self.layout == "padded":
            out["full_attention"] = f"{self.attn_impl} (plain causal), one right-padded row per document"
        elif "full_attention" in kinds:
            how = {"sdpa": "block-diagonal causal boolean mask", "eager": "block-diagonal causal additive mask",
                   "flash_attention_2": "cu_seqlens varlen"}[self.attn_impl]
            out["full_attention"] = f"{self.attn_impl} ({how}), per-document positions"
        if self.linear_path == "fla":
            out["linear_attention"] = (f"fla {self._gdn.fla_ops.version}: causal_conv1d(cu_seqlens) + "
                                       "chunk_gated_delta_rule(cu_seqlens), one varlen call per layer")
        elif self.linear_path == "torch":
            from .kernels import hf_linear_attn_impl

            impl = hf_linear_attn_impl(self._gdn.modules[0][1])
            out["linear_attention"] = f"torch: transformers GDN forward once per document (its rule: {impl})"
        return out

    def _install_hooks(self) -> list:
        H = self.bundle.hidden_size
        layers = decoder_layers(self.model)
        handles = []
        for j, layer_id in enumerate(self.layer_ids):
            # HF's hidden_states[L] is after the final norm; keep `= hidden_states[id + 1]` exact.
            module = final_norm(self.model) if layer_id == self.bundle.num_layers - 1 else layers[layer_id]
            if module is None:
                module = layers[layer_id]

            def hook(_mod, _inp, out, j=j):
                if self._buffer is None:      # a forward outside run(): not ours to capture
                    return
                h = out[0] if isinstance(out, (tuple, list)) else out
                h = h[0] if self._valid is None else h.reshape(-1, H).index_select(0, self._valid)
                self._buffer[:, j * H:(j + 1) * H].copy_(h)

            handles.append(module.register_forward_hook(hook))
        return handles

    def close(self) -> None:
        """Remove the hooks and the GDN patch (the model is a plain HF model again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._staged = None
        if self._gdn is not None:
            self._gdn.restore()
            self._gdn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @torch.inference_mode()
    def run(self, input_ids_T, doc_lens: Sequence[int], capture: bool = True, logits: str = "topk") -> TargetOutput:
        """Features of one packed row: documents of `doc_lens` tokens, concatenated in `input_ids_T`.

        capture=False / logits="plain" give the plain forward the extraction benchmark compares
        against (no hooks copying, full-vocab logits computed and dropped).
        """
        if not self._hooks:
            raise UsageError("this TargetRunner was closed")
        ids = _as_ids(input_ids_T, self.bundle.vocab_size, self.device)
        row = make_packed_row(doc_lens, ids.numel())
        if self.layout == "padded" and row.num_docs > 1:
            return self._run_padded(ids, row, capture, logits)
        self._buffer = self._new_buffer(row.total, capture)
        staged = stage_row(row, self.device, FLA_CHUNK if self.linear_path == "fla" else None)
        self._staged = staged
        kwargs = {}
        mask = None
        if self.attn_impl == "flash_attention_2":
            # varlen kwargs for one document too: without them transformers probes position_ids for
            # packing in every layer (`_is_packed_sequence`, a host sync per layer).
            kwargs = flash_varlen_kwargs(row, self.device, staged.cu_seqlens)
        else:
            mask = block_causal_mask(row, self.device, self.attn_impl, self.bundle.dtype, staged.doc_ids)
        # One document: the model's own positions (0..T-1) equal ours; no copy to hand over.
        positions = staged.positions if row.num_docs > 1 else None
        if mask is None and self._mask_mapping is not None:
            mask = dict(self._mask_mapping)
        try:
            packing = self._gdn.packing(row, staged) if self._gdn is not None else _null_context()
            with packing:
                out = text_backbone(self.model)(input_ids=ids[None], attention_mask=mask, position_ids=positions,
                                                use_cache=False, **kwargs)
            hidden = self._buffer
        finally:
            self._buffer = None
        return self._head(out.last_hidden_state[0], hidden, logits)

    def _run_padded(self, ids: torch.Tensor, row, capture: bool, logits: str) -> TargetOutput:
        """One right-padded row per document (attention-only targets): [n, L] ids, causal attention, no mask;
        the real tokens' rows gathered back into packed order (module docstring)."""
        n, L, H = row.num_docs, max(row.doc_lens), self.bundle.hidden_size
        valid = torch.cat([torch.arange(n_i) + i * L for i, n_i in enumerate(row.doc_lens)])   # host: no sync
        if self.device.type == "cuda":
            valid = valid.pin_memory()
        self._valid = valid.to(self.device, non_blocking=True)
        padded = torch.zeros(n * L, dtype=ids.dtype, device=self.device)   # pad id 0: after every real token
        padded[self._valid] = ids
        self._buffer = self._new_buffer(row.total, capture)
        try:
            # sdpa: {layer type: None} skips transformers' mask builder (a host sync); with no mask each layer
            # attends causally (is_causal). eager builds its causal mask itself (_mask_mapping is None there).
            mask = dict(self._mask_mapping) if self._mask_mapping is not None else None
            out = text_backbone(self.model)(input_ids=padded.view(n, L), attention_mask=mask, use_cache=False)
            hidden = self._buffer
            last = out.last_hidden_state.reshape(n * L, H).index_select(0, self._valid)
        finally:
            self._buffer, self._valid = None, None
        return self._head(last, hidden, logits)

    def _new_buffer(self, T: int, capture: bool) -> torch.Tensor | None:
        """The [T, n_layers * H] buffer the hooks write the captured layers into (None: no capture)."""
        return torch.empty((T, len(self.layer_ids) * self.bundle.hidden_size), dtype=self.hidden_dtype,
                           device=self.device) if capture else None

    def _head(self, last_TH: torch.Tensor, hidden: torch.Tensor | None, logits: str) -> TargetOutput:
        topk_ids = topk_lp = None
        if logits == "plain":
            self.model.get_output_embeddings()(last_TH)
        elif self.topk:
            softcap = getattr(self.bundle.config, "final_logit_softcapping", None)
            topk_ids, topk_lp = chunked_topk_logprobs(last_TH, self.model.get_output_embeddings(),
                                                      self.topk, self.logits_chunk, softcap)
        return TargetOutput(hidden, topk_ids, topk_lp)


class _null_context:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@torch.inference_mode()
def standalone_features(bundle: TargetBundle, input_ids_T, layer_ids: Sequence[int], topk: int = 0) -> TargetOutput:
    """The reference: plain HF forward of ONE document, `output_hidden_states[id + 1]` per layer id.

    Features stay in the model dtype; top-k (if asked) comes from the full logits in float32.
    Run it on a model without an active TargetRunner patch context (a runner's patch is inert
    outside `run`, so sharing the model is fine).
    """
    ids = _as_ids(input_ids_T, bundle.vocab_size, bundle.device)
    layer_ids = validate_layer_ids(layer_ids, bundle.num_layers)
    out = bundle.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    hidden = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    topk_ids = topk_lp = None
    if topk:
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        vals, idx = torch.topk(logp, topk, dim=-1)
        topk_ids, topk_lp = idx.to(torch.int32), vals.to(torch.float16)
    return TargetOutput(hidden, topk_ids, topk_lp)
