"""Shape and identity of a DFlash drafter, and the rules that derive it from the target.

`DrafterModelConfig` is everything needed to build `DFlashDrafter` and to write the exported
`config.json` (SPEC §9). `derive_drafter_config` turns the target's text config (a plain dict
from the target loader) plus the user's `[drafter]` overrides into one, applying SPEC §4:

* hidden size = the target's: the drafter reads the target's embeddings and feeds the target's
  frozen lm_head, so there is no choice here;
* query heads / KV heads / MLP width = the target's unless overridden;
* head_dim = 128 when the hidden size is a multiple of 128, else hidden / heads. It is never
  inherited: Qwen3.5/3.6 use head_dim 256 with partial rotary and mrope, and drafts trained with
  those settings accept far fewer tokens (z-lab's published Qwen3.5 drafts use plain 128-dim RoPE);
* rope_theta = 1e7 for the Qwen3.5 family, 1e6 for Qwen3, else the target's;
* mask token = 248070 (Qwen3.5/3.6) or 151669 (Qwen3), both the first unused embedding row of
  those vocabularies; other families need the caller to name an unused row. A family's known id
  is only used when it fits the vocabulary (tiny random presets reuse the family name with a
  49,152-token vocabulary).

Sentinels follow `dflash_pipe.config.DrafterConfig`: 0 / 0.0 = "derive", mask_token_id -1 =
"derive", so `derive_drafter_config(target, **dataclasses.asdict(run_cfg.drafter), ...)` works.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError, ValidationError

QWEN35_MASK_TOKEN_ID = 248070
QWEN3_MASK_TOKEN_ID = 151669
DEFAULT_HEAD_DIM = 128
ATTENTION_PATHS = ("flex", "sdpa", "sdpa-grouped")


def family_kind(family: str) -> str:
    """Normalise a family name: 'qwen3.5' (also 3.6 / qwen3_5 / qwen3_5_moe / qwen3_next), 'qwen3', or as given."""
    f = (family or "").strip().lower().replace("_", ".").replace("-", ".")
    if f.startswith(("qwen3.5", "qwen3.6", "qwen3.next", "qwen35", "qwen36")):
        return "qwen3.5"
    if f.startswith("qwen3"):
        return "qwen3"
    return f


@dataclass
class DrafterModelConfig:
    """Architecture of one drafter. All sizes are final (no sentinels)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    vocab_size: int
    attention: str = "sdpa"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    @property
    def num_target_features(self) -> int:
        """How many target layers are concatenated in the input (n in fc: n*H -> H)."""
        return len(self.target_layer_ids)

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate(self) -> None:
        where = "drafter config"
        positive = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size", "num_target_layers", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.block_size < 2:
            raise UsageError(f"{where}: block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})", "pick KV heads that divide the heads")
        if self.head_dim % 2:
            raise UsageError(f"{where}: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise UsageError(f"{where}: rms_norm_eps and rope_theta must be > 0 "
                             f"(got {self.rms_norm_eps}, {self.rope_theta})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UsageError(f"{where}: mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})", "pass --mask-token-id with an unused embedding row")
        if not self.target_layer_ids:
            raise UsageError(f"{where}: target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise UsageError(f"{where}: target layer id {bad[0]} is outside 0..{self.num_target_layers - 1} "
                             "(0-based decoder-layer index)")
        if self.attention not in ATTENTION_PATHS:
            raise UsageError(f"{where}: attention must be one of {', '.join(ATTENTION_PATHS)}, got {self.attention!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "drafter config") -> "DrafterModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValidationError(f"{where}: unknown drafter config key(s) {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValidationError(f"{where}: incomplete drafter config: {exc}") from None


def _pick_head_dim(hidden: int, heads: int, override: int) -> int:
    if override > 0:
        return override
    if hidden % DEFAULT_HEAD_DIM == 0:
        return DEFAULT_HEAD_DIM
    if hidden % heads:
        raise UsageError(f"drafter: hidden size {hidden} is neither a multiple of {DEFAULT_HEAD_DIM} nor of the "
                         f"{heads} query heads, so no head_dim can be derived", "pass --head-dim explicitly")
    return hidden // heads


def derive_drafter_config(
    target_cfg: dict[str, Any],
    *,
    target_layer_ids: list[int],
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int = -1,
    unused_embedding_row: int | None = None,
    num_attention_heads: int = 0,
    num_key_value_heads: int = 0,
    head_dim: int = 0,
    intermediate_size: int = 0,
    rope_theta: float = 0.0,
    rms_norm_eps: float = 1e-6,
    attention: str = "auto",
    device_type: str = "cpu",
) -> DrafterModelConfig:
    """Drafter shape for a target (SPEC §4 defaults, each overridable).

    target_cfg: {family, hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
    rope_theta, vocab_size, num_layers} (+ optional max_position_embeddings).
    unused_embedding_row: first embedding row no real token uses; required for families without a
    known mask id (the caller finds it from the tokenizer). attention 'auto' = flex on CUDA.
    """
    need = ("family", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_layers")
    missing = [k for k in need if target_cfg.get(k) in (None, "")]
    if missing:
        raise ValidationError(f"target config: missing {', '.join(missing)} needed to shape the drafter")
    kind = family_kind(str(target_cfg["family"]))
    hidden = int(target_cfg["hidden_size"])
    vocab = int(target_cfg["vocab_size"])
    heads = num_attention_heads or int(target_cfg["num_attention_heads"])
    kv_heads = num_key_value_heads or int(target_cfg.get("num_key_value_heads") or heads)
    if kv_heads > heads or heads % kv_heads:
        raise UsageError(f"drafter: {heads} query heads cannot share {kv_heads} KV heads",
                         "pass --num-key-value-heads that divides --num-attention-heads")

    if rope_theta > 0:
        theta = float(rope_theta)
    elif kind == "qwen3.5":
        theta = 1e7
    elif kind == "qwen3":
        theta = 1e6
    else:
        theta = float(target_cfg.get("rope_theta") or 10000.0)

    if mask_token_id >= 0:
        mask_id = int(mask_token_id)
    else:
        known = {"qwen3.5": QWEN35_MASK_TOKEN_ID, "qwen3": QWEN3_MASK_TOKEN_ID}.get(kind)
        if known is not None and known < vocab:
            mask_id = known
        elif unused_embedding_row is not None:
            mask_id = int(unused_embedding_row)
        else:
            raise UsageError(f"drafter: no MASK token id known for target family '{target_cfg['family']}' "
                             f"with vocab {vocab}, and no unused embedding row was found",
                             "pass --mask-token-id with an embedding row that no real token uses")

    if attention == "auto":
        attention = "flex" if device_type == "cuda" else "sdpa"
    return DrafterModelConfig(
        hidden_size=hidden,
        num_layers=int(num_layers),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_pick_head_dim(hidden, heads, int(head_dim)),
        intermediate_size=intermediate_size or int(target_cfg["intermediate_size"]),
        rms_norm_eps=float(rms_norm_eps),
        rope_theta=theta,
        block_size=int(block_size),
        mask_token_id=mask_id,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=int(target_cfg["num_layers"]),
        vocab_size=vocab,
        attention=attention,
        max_position_embeddings=int(target_cfg.get("max_position_embeddings") or 131072),
    )
