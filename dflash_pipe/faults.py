"""Fault injection for the reliability tests: SIGKILL this process at a named point.

Set ``DFLASH_FAULT=<point>`` (optionally ``<point>@<n>`` = on the n-th time the point is reached,
1-based) and the process kills itself with SIGKILL there, exactly like an OOM-killer or a node
loss would: no cleanup handlers run. Unset (the normal case) this is a dictionary lookup.

Points: extract.forward, extract.compress, extract.upload (object storage: after each row group handed
to the shard's upload, which is not complete yet), extract.before_rename, extract.before_sidecar,
extract.before_manifest, train.after_step, train.checkpoint.before_marker,
train.checkpoint.before_rename, train.checkpoint.between_renames (a step written again: the complete one moved
aside, the new one not yet in place), train.window.after_retire, train.window.before_delete.
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("DFLASH_FAULT")
    if not spec:
        return
    point, _, nth = spec.partition("@")
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def trace_batch(step: int, epoch: int, rank: int, sample_ids) -> None:
    """Test instrumentation: with ``DFLASH_TRACE=<path>`` append which documents each trained step read
    (one JSON line per step and rank; the kill tests count (document, pass) pairs from it)."""
    path = os.environ.get("DFLASH_TRACE")
    if not path:
        return
    import json

    with open(f"{path}.rank{rank}", "a") as f:
        f.write(json.dumps({"step": step, "epoch": epoch, "docs": list(sample_ids)}) + "\n")
