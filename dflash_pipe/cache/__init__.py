"""The feature cache format, shared by both stages: codec, schema, writer, reader, manifest."""

from .codec import CODECS, FP8, LOSSLESS, EncodedHidden, encode_hidden, planes_to_hidden
from .manifest import (MANIFEST_FILE, SPEC_FILE, committed_shards, init_or_check_spec, load_manifest, load_spec,
                       make_spec, try_finalize, write_sidecar)
from .reader import RowRef, ShardReader
from .schema import shard_name
from .verify import verify_cache
from .writer import EncodedRow, ShardInfo, ShardWriter

__all__ = ["CODECS", "FP8", "LOSSLESS", "EncodedHidden", "encode_hidden", "planes_to_hidden", "MANIFEST_FILE",
           "SPEC_FILE", "committed_shards", "init_or_check_spec", "load_manifest", "load_spec", "make_spec",
           "try_finalize", "write_sidecar", "RowRef", "ShardReader", "shard_name", "verify_cache", "EncodedRow",
           "ShardInfo", "ShardWriter"]
