"""Resumable eval: every finished prompt is appended (and fsynced) to ``eval_progress.jsonl``.

A rerun of the same eval (same drafters and their files, target weights and dtype, token budget
and block size: the run key) takes the finished prompts from the file instead of decoding them again, so
an eval stopped by Ctrl-C, a timeout or a lost machine continues where it was (on another machine too, with
the file and the drafter's export carried there). The file is
removed once the report has been written, so a later rerun measures afresh. A line cut by a kill
is ignored and cut off the file before anything is appended; a file written under another run key is replaced.
Each line carries a hash of its prompt's token ids: a prompt whose text changed under the same id (another data
source, chat template or prompt file) is decoded again, not taken from the file. With batched references
(reference_batch.py) a line also says whether the batch-1 output equalled the batched reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from ..io_utils import append_durably, read_jsonl, sha256_file
from .specdecode import SpecResult

PROGRESS_FILE = "eval_progress.jsonl"


def run_key(drafters: list[tuple[str, Path]], identity: dict, max_new_tokens: int, block_size: int,
            prompts: str) -> str:
    """drafters: (method, export dir) pairs, in report order. A drafter counts by its files' contents, not their
    paths or times, so the same export copied to another machine (the quality driver's drafter parts) keeps the
    progress made with it; a retrained one starts afresh."""
    h = hashlib.sha256()
    for method, export_dir in drafters:
        h.update(f"{method}\n".encode())
        for name in ("config.json", "model.safetensors"):
            p = Path(export_dir) / name
            h.update(f"{name}:{sha256_file(p) if p.exists() else '-'}\n".encode())
    h.update(json.dumps({k: identity.get(k) for k in ("model", "weights_fingerprint", "dtype")}, sort_keys=True,
                        default=str).encode())
    h.update(f"{max_new_tokens}:{block_size}:{prompts}".encode())
    return h.hexdigest()[:16]


class EvalProgress:
    def __init__(self, out_dir: Path, key: str):
        self.path = Path(out_dir) / PROGRESS_FILE
        self.key = key
        self.done: dict[tuple[str, str], dict] = {}
        if self.path.exists():
            _cut_torn_tail(self.path)  # else the next append would join the fragment and be lost in turn
            for rec in read_jsonl(self.path):
                if rec.get("key") == key:
                    self.done[(rec["set"], rec["id"])] = rec
            if not self.done:
                self.path.unlink()  # another run's progress

    def get(self, set_name: str, prompt_id: str, prompt_ids: list[int]):
        """(reference tokens, reference wall s, {method: SpecResult}) of a finished prompt, or None (also when
        the prompt recorded under that id had other tokens)."""
        rec = self.done.get((set_name, prompt_id))
        if rec is None or rec.get("prompt") != prompt_hash(prompt_ids):
            return None
        return rec["ref"], rec["ref_wall"], {m: SpecResult(**r) for m, r in rec["results"].items()}

    def add(self, set_name: str, prompt_id: str, prompt_ids: list[int], ref: list[int], ref_wall: float | None,
            results: dict[str, SpecResult], batch1_equal: bool | None = None) -> None:
        """ref_wall None: target-only was not timed at batch 1 (--reference batched, outside the sample);
        batch1_equal: whether the timed batch-1 output equals the batched reference (None when not compared)."""
        rec = {"key": self.key, "set": set_name, "id": prompt_id, "prompt": prompt_hash(prompt_ids), "ref": ref,
               "ref_wall": ref_wall, "results": {m: dataclasses.asdict(r) for m, r in results.items()}}
        if batch1_equal is not None:
            rec["batch1_equal"] = batch1_equal
        append_durably(self.path, (json.dumps(rec) + "\n").encode("utf-8"))

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def prompt_hash(prompt_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in prompt_ids]).encode()).hexdigest()[:16]


def _cut_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline (a kill mid-append) off the file."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())
