"""Shard writer: rows -> one Parquet file, committed atomically, hashed while it is written.

A shard becomes visible in three steps, each crash-safe:
  1. rows are written to ``.shard-...parquet.tmp-<pid>-<rand>`` (invisible to readers);
  2. the temp file is fsynced and renamed onto ``shard-...parquet``;
  3. its sidecar ``shard-...json`` (rows, tokens, bytes, sha256, stats) is written atomically.
A shard counts as committed only once its sidecar exists and matches the file's size, so a
SIGKILL anywhere leaves either nothing or a file that the next run redoes. On object storage
(see fs.py) steps 1-2 are one upload onto the final name that becomes visible when it completes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import RuntimeFailure, ValidationError
from ..faults import fault_point
from ..io_utils import disk_error, fsync_dir, temp_path_for
from .fs import open_cache_fs
from .upload import Upload
from .schema import MAX_VALUE_BYTES, arrow_schema, column_names, parquet_write_options


@dataclass
class EncodedRow:
    """One document, ready to be written (feature values already compressed by the codec)."""

    sample_id: str
    doc_index: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    hidden: dict  # column -> bytes | uint8 ndarray
    topk_ids: bytes | None = None
    topk_logprobs: bytes | None = None
    raw_feature_bytes: int = 0  # uncompressed bf16 feature bytes (row-group sizing, stats)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ShardInfo:
    path: str  # relative to the cache dir
    index: int
    rows: int
    tokens: int
    supervised_tokens: int
    bytes: int
    sha256: str
    row_groups: int
    raw_feature_bytes: int
    doc_indices_sha256: str = ""
    extra: dict = field(default_factory=dict)


class _HashingFile:
    """Write-only file object that sha256-hashes what passes through (no re-read at commit)."""

    def __init__(self, path: Path | None, upload=None):
        self._upload = upload  # object stores: an fs.Upload onto the final name instead of a temp file
        self._f = open(path, "wb") if upload is None else upload
        self._h = hashlib.sha256()
        self._n = 0
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data)
        self._f.write(mv)
        self._h.update(mv)
        self._n += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        if self._upload is None:
            self._f.flush()

    def sync_data(self) -> None:
        """Push what is written so far to the disk (fdatasync), so that the commit's fsync waits only for
        the last row group and the footer instead of the whole shard (the writer thread pays it in
        between, not the end of a rank's run). An upload sends its parts in the background anyway."""
        if self._upload is not None:
            fault_point("extract.upload")  # a row group handed to the upload, which is not complete
            return
        self._f.flush()
        sync = getattr(os, "fdatasync", os.fsync)  # fdatasync is POSIX; macOS has only fsync
        sync(self._f.fileno())

    def fsync_close(self) -> None:
        if self._upload is not None:
            self._upload.commit()  # the object becomes visible here, whole
            self.closed = True
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self.closed = True

    def drop(self) -> None:
        """Failing: pass no more bytes on (a closing ParquetWriter would write its footer)."""
        if self._upload is not None and not self.closed:
            self._upload.dropped = True

    def close(self) -> None:
        if not self.closed:
            if self._upload is not None:
                self._upload.abort()  # never completes a partial object under the shard's name
            else:
                self._f.close()
            self.closed = True

    @property
    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _binary_column(values: list) -> pa.Array:
    """Concatenate row values into one large_binary array (one copy, no per-row Python objects)."""
    arrays = [np.frombuffer(v, dtype=np.uint8) if not isinstance(v, np.ndarray) else v.reshape(-1).view(np.uint8)
              for v in values]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    data = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(arrays),
                                            [None, pa.py_buffer(offsets), pa.py_buffer(data)])


class ShardWriter:
    def __init__(self, cache_dir: str | Path, name: str, index: int, codec: str, topk: int, meta: dict,
                 row_group_bytes: int = 64 << 20, sync_row_groups: bool = True):
        self.fs = open_cache_fs(cache_dir)
        self.remote = not self.fs.is_local
        self.cache_dir = self.fs.uri if self.remote else self.fs.root
        self.sync_row_groups = sync_row_groups  # fdatasync after every row group (see _HashingFile.sync_data)
        self.name = name
        self.final_path = self.fs.display(name) if self.remote else self.cache_dir / name
        self.index = index
        self.codec, self.topk = codec, topk
        self.columns = column_names(codec, topk)
        self.schema = arrow_schema(codec, topk, meta)
        self.row_group_bytes = row_group_bytes
        # object stores have no rename: the upload goes to the final name and completes at commit
        self.tmp_path = self.final_path if self.remote else temp_path_for(self.final_path)
        self._pending: list[EncodedRow] = []
        self._pending_bytes = 0
        self.rows = self.tokens = self.supervised = self.row_groups = self.raw_bytes = 0
        self._doc_hash = hashlib.sha256()
        self._file = None
        try:
            self._file = (_HashingFile(None, self.fs.call(f"starting the upload of {self.final_path}", Upload,
                                                          self.fs, name))
                          if self.remote else _HashingFile(self.tmp_path))
            self._writer = pq.ParquetWriter(self._file, self.schema, **parquet_write_options(self.columns))
        except BaseException as exc:  # e.g. ENOSPC on the header write: leave no temp file behind
            if self._file is not None:
                self._file.close()
            if not self.remote:
                self.tmp_path.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise disk_error(exc, self.tmp_path, "creating") from exc
            raise

    def add(self, row: EncodedRow) -> None:
        for col, v in row.hidden.items():
            if len(memoryview(v).cast("B")) > MAX_VALUE_BYTES:
                raise ValidationError(
                    f"document {row.sample_id}: column {col} would be {len(memoryview(v))} bytes, over Parquet's "
                    f"2 GiB value limit", "lower --max-length or capture fewer layers")
        self._pending.append(row)
        self._pending_bytes += row.raw_feature_bytes
        if self._pending_bytes >= self.row_group_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        rows = self._pending
        cols = {
            "sample_id": pa.array([r.sample_id for r in rows], pa.string()),
            "doc_index": pa.array([r.doc_index for r in rows], pa.int64()),
            "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
            "input_ids": _binary_column([r.input_ids.astype("<i4", copy=False) for r in rows]),
            "loss_mask": _binary_column([r.loss_mask.astype(np.uint8, copy=False) for r in rows]),
        }
        for col in self.columns:
            if col.startswith("hidden_"):
                cols[col] = _binary_column([r.hidden[col] for r in rows])
        if self.topk > 0:
            cols["topk_ids"] = _binary_column([r.topk_ids for r in rows])
            cols["topk_logprobs"] = _binary_column([r.topk_logprobs for r in rows])
        table = pa.Table.from_arrays([cols[c] for c in self.columns], schema=self.schema)
        try:
            self._writer.write_table(table, row_group_size=len(rows))
        except OSError as exc:
            raise disk_error(exc, self.tmp_path, "writing") from exc
        for r in rows:
            self.rows += 1
            self.tokens += r.num_tokens
            self.supervised += int(r.loss_mask.sum())
            self.raw_bytes += r.raw_feature_bytes
            self._doc_hash.update(f"{r.doc_index}:{r.sample_id}\n".encode())
        self.row_groups += 1
        self._pending, self._pending_bytes = [], 0
        if self.sync_row_groups:
            try:
                self._file.sync_data()
            except OSError as exc:
                raise disk_error(exc, self.tmp_path, "writing") from exc

    def commit(self) -> ShardInfo:
        """Flush, fsync, rename onto the final name. The caller then writes the sidecar."""
        try:
            self._flush()
            self._writer.close()
            if self.remote:
                fault_point("extract.before_rename")  # = before the upload completes
                self._file.fsync_close()
                size = self.fs.size(self.name)
                if size != self._file.tell():
                    raise RuntimeFailure(f"upload of {self.final_path}: the store holds {size} bytes, "
                                         f"{self._file.tell()} were written", "rerun `dflash-pipe extract`")
            else:
                self._file.fsync_close()
                size = self.tmp_path.stat().st_size
                fault_point("extract.before_rename")
                os.replace(self.tmp_path, self.final_path)
                fsync_dir(self.cache_dir)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, self.final_path, "committing") from exc
        except BaseException:
            self.abort()
            raise
        return ShardInfo(path=self.name, index=self.index, rows=self.rows, tokens=self.tokens,
                         supervised_tokens=self.supervised, bytes=size, sha256=self._file.hexdigest,
                         row_groups=self.row_groups, raw_feature_bytes=self.raw_bytes,
                         doc_indices_sha256=self._doc_hash.hexdigest())

    def abort(self) -> None:
        self._file.drop()
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - already failing; the temp file is removed below
            pass
        try:
            self._file.close()  # an upload: aborted (nothing stays visible under the shard's name)
        except OSError:  # a disk-full flush of the buffered tail: the file is discarded anyway
            pass
        finally:
            if not self.remote:
                self.tmp_path.unlink(missing_ok=True)


def make_row(sample_id: str, doc_index: int, input_ids: np.ndarray, loss_mask: np.ndarray, enc_hidden,
             topk_ids=None, topk_logprobs=None) -> EncodedRow:
    """Compress one document's planes (CPU tensors) into a writable row. Runs in the worker pool."""
    from .codec import compress_hidden, encode_split

    return EncodedRow(
        sample_id=sample_id, doc_index=doc_index,
        input_ids=np.ascontiguousarray(input_ids, dtype=np.int32),
        loss_mask=np.ascontiguousarray(loss_mask, dtype=np.uint8),
        hidden=compress_hidden(enc_hidden),
        topk_ids=None if topk_ids is None else encode_split(topk_ids),
        topk_logprobs=None if topk_logprobs is None else encode_split(topk_logprobs),
        raw_feature_bytes=enc_hidden.num_tokens * enc_hidden.width * 2,
    )
