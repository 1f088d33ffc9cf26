"""Fault injection for the reliability tests: SIGKILL this process at a named point.

Set ``DFLASH_FAULT=<point>`` (optionally ``<point>@<n>`` = on the n-th time the point is reached,
1-based) and the process kills itself with SIGKILL there, exactly like an OOM-killer or a node
loss would: no cleanup handlers run. Unset (the normal case) this is a dictionary lookup.

Points: extract.forward, extract.compress, extract.before_rename, extract.before_sidecar,
extract.before_manifest, train.after_step, train.checkpoint.before_marker,
train.checkpoint.before_rename.
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
