"""Which target layers feed the drafter, and the index convention they are named in.

Convention (SPEC §2, recorded in every cache manifest): a layer id is the 0-based index of a
decoder layer, and its feature is that layer's *output*, i.e. Hugging Face
``output_hidden_states[id + 1]`` (entry 0 is the embedding output). HF's last entry is taken
after the final norm, so for ``id == L - 1`` the runner captures the final norm's output to keep
the equality exact; the DFlash defaults never pick that layer for n >= 2 (n == 1 gives L // 2,
which is L - 1 only for L <= 2).

vLLM (and SGLang) capture a layer's *input*, i.e. the output of layer id as the input of layer
id + 1, so neither has a feature for id L - 1: a drafter that uses it cannot be served by vLLM.
`check_servable` refuses that choice unless the user says so ([extract] allow_unservable_layers).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UsageError

LAYER_ID_CONVENTION = "0-based decoder layer index; feature = layer output = HF output_hidden_states[id + 1]"


def default_target_layer_ids(num_layers_to_capture: int, num_target_layers: int) -> list[int]:
    """The DFlash default: n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)), i = 0..n-1.

    Spreads the captured layers from the second layer to three before the last (L=36 ->
    [1, 9, 17, 25, 33]; L=64 -> [1, 16, 31, 46, 61]). Python's round() is banker's rounding;
    the z-lab trainers use it too, so ties resolve the same way.
    """
    n, L = num_layers_to_capture, num_target_layers
    if n < 1:
        raise UsageError(f"number of target layers to capture must be >= 1, got {n}")
    if L < 1:
        raise UsageError(f"the target must have at least one decoder layer, got {L}")
    if n == 1:
        ids = [L // 2]
    else:
        ids = [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
        if len(set(ids)) != n or min(ids) < 0 or max(ids) >= L:
            # The rule needs L >= n + 3 to give n distinct layers.
            raise UsageError(f"the DFlash rule cannot spread {n} capture layers over a {L}-layer target "
                             f"(it gives {ids})", "pass the layer ids explicitly, or capture fewer layers")
    validate_layer_ids(ids, L)
    return ids


def validate_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Refuse empty, non-integer, out-of-range, duplicated or unsorted ids (returns them as a list).

    Sorted order is required because the cache concatenates layers in `layer_ids` order and
    every consumer (drafter fc weight, manifest comparison) assumes the canonical order.
    """
    ids = list(layer_ids)
    if not ids:
        raise UsageError("layer_ids is empty", "pass at least one layer, or leave it empty for the DFlash default")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise UsageError(f"layer_ids must be integers, got {i!r} in {ids}")
        if not 0 <= i < num_target_layers:
            raise UsageError(f"layer id {i} is out of range for a {num_target_layers}-layer target",
                             f"ids are 0-based decoder-layer indices in [0, {num_target_layers - 1}]")
    if len(set(ids)) != len(ids):
        raise UsageError(f"layer_ids has duplicates: {ids}")
    if ids != sorted(ids):
        raise UsageError(f"layer_ids must be increasing: {ids}", f"use {sorted(ids)}")
    return ids


def check_servable(layer_ids: Sequence[int], num_target_layers: int, allowed: bool, override: str) -> None:
    """Refuse the target's last layer (id L - 1) unless `allowed`: vLLM cannot serve such a drafter.

    `override` says how the current command accepts the explicit choice (it ends the error's hint)."""
    last = num_target_layers - 1
    if allowed or last not in layer_ids:
        return
    raise UsageError(f"layer ids {list(layer_ids)} include {last}, the last layer of this {num_target_layers}-layer "
                     f"target: vLLM captures the input of layer id + 1, so it cannot serve a drafter that uses "
                     f"layer {last}",
                     f"choose layers below {last} (an empty --layer-ids gives the DFlash default); to train a "
                     f"drafter that vLLM will not serve, {override}")


def check_extract_length(config, max_length: int) -> None:
    """Refuse an [extract] max_length the target cannot take as extraction runs it: past its context
    (max_position_embeddings), or past the window of its sliding-window layers (extraction's block-causal masks
    have no window: a token would attend further back than the target itself ever does, so its features would be
    ones the served target never computes)."""
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and 0 < context < max_length:
        raise UsageError(f"[extract] max_length {max_length} exceeds the target's context of {context} tokens "
                         f"(max_position_embeddings)", f"set [extract] max_length to at most {context} in the manifest")
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in types or bool(getattr(config, "use_sliding_window", False))
    if sliding and isinstance(window, int) and 0 < window < max_length:
        raise UsageError(f"the target has sliding-window attention layers (window {window} tokens) and [extract] "
                         f"max_length is {max_length}: extraction's attention masks have no window, so tokens past "
                         f"{window} would get features the target never computes",
                         f"set [extract] max_length to at most {window} in the manifest")
