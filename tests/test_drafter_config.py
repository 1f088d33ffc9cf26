"""derive_drafter_config applies the SPEC §4 defaults and honours overrides."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_pipe.config import DrafterConfig
from dflash_pipe.drafter.config import DrafterModelConfig, derive_drafter_config, family_kind
from dflash_pipe.errors import UsageError, ValidationError

QWEN3_8B = dict(family="qwen3", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=12288, rope_theta=1e6, vocab_size=151936, num_layers=36)
QWEN35_27B = dict(family="qwen3.5", hidden_size=5120, num_attention_heads=24, num_key_value_heads=4,
                  intermediate_size=17408, rope_theta=1e7, vocab_size=248320, num_layers=64)
SMOLLM2 = dict(family="llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, rope_theta=100000.0, vocab_size=49152, num_layers=30)


def test_qwen3_defaults():
    cfg = derive_drafter_config(QWEN3_8B, target_layer_ids=[1, 9, 17, 25, 33])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4096, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.rope_theta) == (128, 12288, 1e6)
    assert (cfg.mask_token_id, cfg.num_target_layers, cfg.vocab_size) == (151669, 36, 151936)
    assert (cfg.num_layers, cfg.block_size, cfg.attention) == (5, 16, "sdpa")
    assert cfg.num_target_features == 5


def test_qwen35_never_inherits_head_dim_256_and_uses_theta_1e7():
    cfg = derive_drafter_config(dict(QWEN35_27B, head_dim=256, partial_rotary_factor=0.25),
                                target_layer_ids=[1, 16, 31, 46, 61], device_type="cuda")
    assert cfg.head_dim == 128 and cfg.rope_theta == 1e7 and cfg.mask_token_id == 248070
    assert cfg.attention == "flex"
    assert family_kind("Qwen3_5_moe") == family_kind("qwen3.6") == "qwen3.5"


def test_other_family_needs_an_unused_row_and_derives_head_dim_from_heads():
    with pytest.raises(UsageError, match="mask-token-id"):
        derive_drafter_config(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 26])
    cfg = derive_drafter_config(SMOLLM2, target_layer_ids=[1, 8, 15, 22, 26], unused_embedding_row=49151)
    assert cfg.head_dim == 576 // 9 and cfg.rope_theta == 100000.0 and cfg.mask_token_id == 49151


def test_known_mask_id_outside_a_small_vocab_falls_back_to_the_unused_row():
    tiny = dict(QWEN35_27B, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                num_layers=4)
    cfg = derive_drafter_config(tiny, target_layer_ids=[1, 2], unused_embedding_row=100)
    assert (cfg.mask_token_id, cfg.head_dim, cfg.rope_theta) == (100, 16, 1e7)
    with pytest.raises(UsageError, match="mask-token-id"):
        derive_drafter_config(tiny, target_layer_ids=[1, 2])


def test_overrides_from_the_run_config_section():
    over = dataclasses.asdict(DrafterConfig(num_layers=3, block_size=8, num_attention_heads=16, num_key_value_heads=4,
                                            head_dim=64, intermediate_size=1000, rope_theta=5e5, mask_token_id=7,
                                            attention="sdpa"))
    cfg = derive_drafter_config(QWEN3_8B, target_layer_ids=[2, 30], **over)
    assert (cfg.num_layers, cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 8, 16, 4)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.rope_theta, cfg.mask_token_id) == (64, 1000, 5e5, 7)
    defaults = derive_drafter_config(QWEN3_8B, target_layer_ids=[2, 30], **dataclasses.asdict(DrafterConfig()))
    assert defaults == derive_drafter_config(QWEN3_8B, target_layer_ids=[2, 30])


def test_invalid_shapes_are_refused():
    with pytest.raises(UsageError, match="KV heads"):
        derive_drafter_config(QWEN3_8B, target_layer_ids=[1], num_key_value_heads=5)
    with pytest.raises(UsageError, match="outside 0..35"):
        derive_drafter_config(QWEN3_8B, target_layer_ids=[1, 36])
    with pytest.raises(UsageError, match="outside the vocabulary"):
        derive_drafter_config(QWEN3_8B, target_layer_ids=[1], mask_token_id=151936)
    with pytest.raises(UsageError, match="head_dim"):
        derive_drafter_config(dict(SMOLLM2, hidden_size=577), target_layer_ids=[1], unused_embedding_row=1)
    with pytest.raises(ValidationError, match="missing"):
        derive_drafter_config({"family": "qwen3"}, target_layer_ids=[1])


def test_dict_round_trip_and_unknown_keys():
    cfg = derive_drafter_config(QWEN3_8B, target_layer_ids=[1, 9])
    assert DrafterModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValidationError, match="bogus"):
        DrafterModelConfig.from_dict(dict(cfg.to_dict(), bogus=1))
