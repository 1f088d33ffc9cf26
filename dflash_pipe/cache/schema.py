"""The Parquet schema of a cache shard: one row per document (sequence).

Columns
  sample_id      string    the conversation id from the data (unique within the cache)
  doc_index      int64     position of the document among all valid samples (exactly-once checks)
  num_tokens     int32     T
  input_ids      binary    int32 little-endian [T]                 (Parquet zstd)
  loss_mask      binary    uint8 [T], 1 on assistant tokens       (Parquet zstd)
  hidden_hi/lo   binary    lossless codec planes, see codec.py    (already compressed / raw)
  hidden_q       binary    fp8 codec bytes, zstd-1
  hidden_scale   binary    fp8 per-(token, layer) fp32 scales     (Parquet zstd)
  topk_ids       binary    int32 [T, k] byte planes + zstd-1       (only if topk > 0)
  topk_logprobs  binary    fp16 [T, k] byte planes + zstd-1        (only if topk > 0)

Parquet settings: no dictionary, no statistics, page CRC checksums on (a flipped byte is caught
by the reader), 1 MiB data pages. File metadata key ``dflash_pipe`` holds the codec description.
"""

from __future__ import annotations

import json

import pyarrow as pa

from .codec import FP8, LOSSLESS, hidden_columns

FORMAT_VERSION = 1
META_KEY = b"dflash_pipe"
# Parquet stores a binary value's length in 32 bits: keep each value well under 2 GiB.
MAX_VALUE_BYTES = (1 << 31) - (1 << 20)

BASE_COLUMNS = ("sample_id", "doc_index", "num_tokens", "input_ids", "loss_mask")
TOPK_COLUMNS = ("topk_ids", "topk_logprobs")
# Columns Parquet should compress itself (small, or not yet compressed by us).
PARQUET_ZSTD = {"sample_id", "input_ids", "loss_mask", "hidden_scale", "doc_index", "num_tokens"}


def column_names(codec: str, topk: int) -> tuple[str, ...]:
    return BASE_COLUMNS + hidden_columns(codec) + (TOPK_COLUMNS if topk > 0 else ())


def arrow_schema(codec: str, topk: int, meta: dict) -> pa.Schema:
    if codec not in (LOSSLESS, FP8):
        raise ValueError(f"unknown codec {codec!r}")
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("doc_index", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("input_ids", pa.large_binary(), nullable=False),
        pa.field("loss_mask", pa.large_binary(), nullable=False),
    ]
    fields += [pa.field(c, pa.large_binary(), nullable=False) for c in hidden_columns(codec)]
    if topk > 0:
        fields += [pa.field(c, pa.large_binary(), nullable=False) for c in TOPK_COLUMNS]
    return pa.schema(fields, metadata={META_KEY: json.dumps(meta, sort_keys=True).encode()})


def shard_meta(codec: str, topk: int, width: int, num_layers: int, fingerprint: str) -> dict:
    """Self-description stored inside every shard (checked against the manifest by the reader)."""
    return {"format_version": FORMAT_VERSION, "codec": codec, "layout": "channel-major", "topk": topk,
            "width": width, "num_layers": num_layers, "fingerprint": fingerprint}


def parquet_write_options(columns: tuple[str, ...]) -> dict:
    return dict(
        compression={c: ("zstd" if c in PARQUET_ZSTD else "none") for c in columns},
        compression_level={c: 1 for c in columns if c in PARQUET_ZSTD},
        use_dictionary=False,
        write_statistics=False,
        write_page_checksum=True,
        data_page_size=1 << 20,
    )


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.parquet"
