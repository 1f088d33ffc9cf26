"""Provenance hashes of a target: weights, config, tokenizer, chat template.

They go into the cache manifest so that a cache is never silently reused with another model.

Weights fingerprint trade-off. Hashing every byte of a 54 GB checkpoint costs minutes of disk
I/O per run, so `weights_fingerprint_files` hashes, per safetensors file (sorted by name):
its name and size, its whole header (every tensor's name, dtype, shape and byte offsets) and
`SAMPLES_PER_FILE` byte ranges of `SAMPLE_BYTES` spread evenly over the data section (first
and last bytes included). Any change of a header, a shape, a dtype, a file size, or of bytes in
a sampled range changes the hash; a change confined to unsampled bytes of an otherwise
identical file (same size, same header) is not detected. Fine-tunes and re-quantisations
change essentially every tensor and are caught; a deliberate single-byte edit may not be.
About 1 MiB is read per file, so the cost is independent of the model size.

For in-memory (random) models, `weights_fingerprint_tensors` hashes the preset identity
(name, seed, config hash) plus, per parameter, its name, dtype, shape and a strided sample
of its elements, read on the device and copied back in one small transfer.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import CacheError
from ..io_utils import sha256_json

SAMPLES_PER_FILE = 64
SAMPLE_BYTES = 16 << 10
TENSOR_SAMPLES = 256
FINGERPRINT_SCHEME = "dflash-sampled-v1"

# Keys of config.json that describe where/how a file was written, not the model.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype",
                         "_attn_implementation", "_attn_implementation_autoset", "use_cache",
                         "quantization_config", "output_hidden_states", "output_attentions", "return_dict"}


def read_safetensors_header(path: Path) -> tuple[int, bytes]:
    """(header length, raw header JSON bytes) of a safetensors file, validated for size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CacheError(f"{path}: not a safetensors file (shorter than 8 bytes)",
                             "the checkpoint is truncated; re-download or re-convert it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise CacheError(f"{path}: safetensors header length {n} does not fit in a {size}-byte file",
                             "the checkpoint is truncated or not safetensors")
        header = f.read(n)
    return n, header


def _sample_offsets(start: int, end: int, count: int, width: int) -> list[int]:
    """`count` offsets of ranges of `width` bytes spread evenly over [start, end), ends included."""
    span = end - start
    if span <= count * width:
        return [start] if span > 0 else []
    last = end - width
    return sorted({start + (last - start) * i // (count - 1) for i in range(count)})


def weights_fingerprint_files(paths: Iterable[Path]) -> str:
    """Sampled fingerprint of safetensors files (see the module docstring for what it covers)."""
    h = hashlib.sha256(FINGERPRINT_SCHEME.encode())
    files = sorted(Path(p) for p in paths)
    if not files:
        raise CacheError("no safetensors files to fingerprint", "the model directory holds no *.safetensors")
    for path in files:
        size = path.stat().st_size
        n, header = read_safetensors_header(path)
        h.update(f"\0{path.name}\0{size}\0".encode())
        h.update(header)
        data_start = 8 + n
        with open(path, "rb") as f:
            for off in _sample_offsets(data_start, size, SAMPLES_PER_FILE, SAMPLE_BYTES):
                f.seek(off)
                h.update(struct.pack("<Q", off))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).glob("*.safetensors") if not p.name.startswith("."))


def _tensor_sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.numel() <= TENSOR_SAMPLES:
        return flat
    # Integer arithmetic: a float32 linspace cannot address elements past 2**24 exactly (the
    # 248320 x 5120 head has 1.27e9) and would index out of bounds.
    idx = torch.arange(TENSOR_SAMPLES, device=flat.device, dtype=torch.int64) * (flat.numel() - 1)
    return flat[idx // (TENSOR_SAMPLES - 1)]


def weights_fingerprint_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], extra: dict[str, Any]) -> str:
    """Fingerprint of in-memory tensors: `extra` (preset identity) + per-tensor metadata and samples."""
    h = hashlib.sha256(FINGERPRINT_SCHEME.encode())
    h.update(json.dumps(extra, sort_keys=True, separators=(",", ":")).encode())
    items = sorted(named_tensors, key=lambda kv: kv[0])
    samples = [_tensor_sample(t) for _, t in items]
    # One device->host copy for all samples (the 27B shape has ~850 tensors on the GPU).
    flat = torch.cat([s.float().reshape(-1) for s in samples]).cpu() if samples else torch.empty(0)
    pos = 0
    for (name, t), s in zip(items, samples):
        h.update(f"\0{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        h.update(flat[pos:pos + s.numel()].numpy().tobytes())
        pos += s.numel()
    return h.hexdigest()


def canonical_config_dict(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop keys that record the writer or runtime options (version, path, dtype), recursively."""
    out = {}
    for k, v in config_dict.items():
        if k in _VOLATILE_CONFIG_KEYS:
            continue
        out[k] = canonical_config_dict(v) if isinstance(v, dict) else v
    return out


def config_file_hash(config_path: Path) -> str:
    """sha256 of the canonical JSON of a config.json file (stable across transformers releases)."""
    try:
        data = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"{config_path}: cannot read the model config: {exc}",
                         "the model directory is incomplete; re-download or re-convert it") from exc
    return sha256_json(canonical_config_dict(data))


def tokenizer_hash(tokenizer) -> str:
    """sha256 over the vocabulary, the BPE merges and the special tokens.

    These decide the token ids; serialisation details of tokenizer.json (which move between
    `tokenizers` releases) are left out on purpose.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    merges: list[str] = []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", []) or []]
    special = {k: str(v) for k, v in sorted((tokenizer.special_tokens_map or {}).items())}
    return sha256_json({"vocab": vocab, "merges": merges, "special": special})


def chat_template_hash(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def file_sample_digest(path: Path, width: int = 1 << 20) -> str:
    """Cheap identity of a large source file (size + first and last MiB), e.g. the embedded GGUF."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(width))
        if size > width:
            f.seek(max(width, size - width))
            h.update(f.read(width))
    return h.hexdigest()
