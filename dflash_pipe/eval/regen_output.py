"""The output side of `regenerate`: the append-only JSONL, its progress sidecar, the settings it pins.

See the `regenerate` module docstring for the crash-safety contract these implement.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..config import RunConfig
from ..data.sources import dataset_identity
from ..errors import ValidationError
from ..io_utils import append_durably

log = logging.getLogger("dflash_pipe.eval")
SIDECAR_FORMAT = 1
# Decoding settings a sidecar written before they existed implicitly had (greedy, one answer).
DECODING_DEFAULTS = {"samples": 1, "temperature": 0.0, "top_p": 1.0, "seed": 0}
# Settings written only when not 0 (Decoding.settings): absent means 0, in the file and now.
OPTIONAL_ZERO = {"greedy_after": 0, "first_sample": 0}


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.json")


# --------------------------------------------------------------------------- resumable output

def scan_output(output: Path) -> set[str]:
    """Ids already in `output`; a partial last line (no newline) is cut off the file first."""
    done: set[str] = set()
    if not output.exists():
        return done
    good_end = 0
    with open(output, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break                                  # the killed writer's last line
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValidationError(f"{output}:{lineno}: a complete line is not valid JSON ({exc})",
                                      "this file was not written by `dflash-pipe regenerate`, or was edited; "
                                      "use a new --output") from None
            sid = row.get("id") if isinstance(row, dict) else None
            if not isinstance(sid, str) or not isinstance(row.get("messages"), list):
                raise ValidationError(f"{output}:{lineno}: row has no string 'id' or no 'messages' list",
                                      "use a new --output")
            if sid in done:
                raise ValidationError(f"{output}:{lineno}: id {sid!r} appears twice", "use a new --output")
            done.add(sid)
            good_end += len(raw)
    size = output.stat().st_size
    if size != good_end:
        log.warning("%s: dropping a partially written last line (%d bytes)", output, size - good_end)
        with open(output, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


class JsonlAppender:
    """Append-only JSONL output: one durable append per batch (fsynced; cut back to whole lines when a
    full disk fails it, `io_utils.append_durably`)."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        append_durably(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- sidecar

def settings_of(cfg: RunConfig, bundle, max_new_tokens: int, max_turns: int, decoding: dict) -> dict:
    """What the output file pins: a resume with other settings is refused. The source is pinned by content (each
    file's name, size and sha256), so an edited file at the same path is refused and a moved copy resumes."""
    d = cfg.data
    files = dataset_identity(d.source, d.format)["files"]
    return {"target": cfg.target.model, "weights_fingerprint": bundle.identity.get("weights_fingerprint"),
            "chat_template_hash": bundle.identity.get("chat_template_hash"), "dtype": bundle.identity.get("dtype"),
            "source": d.source, "source_files": files, "format": d.format, "skip_samples": d.skip_samples,
            "max_samples": d.max_samples,
            "max_new_tokens": max_new_tokens, "max_length": cfg.extract.max_length,
            "mode": "multi-turn" if not max_turns else f"first {max_turns} turn(s)", **decoding}


def load_sidecar(output: Path, settings: dict) -> dict:
    side = sidecar_path(output)
    fresh = {"format": SIDECAR_FORMAT, "settings": settings, "rows_written": 0, "skipped": {},
             "generated_tokens": 0, "truncated_responses": 0, "prompts_too_long": 0, "empty_answers": 0,
             "seconds": 0.0}
    if not output.exists() or output.stat().st_size == 0:
        return fresh
    try:
        state = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValidationError(f"{output} exists but has no progress sidecar {side.name}",
                              "it was not written by `dflash-pipe regenerate`; pass a new --output") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValidationError(f"{side}: unreadable progress sidecar ({exc})", "pass a new --output") from None
    old = {**DECODING_DEFAULTS, **OPTIONAL_ZERO, **state.get("settings", {})}
    now = {**OPTIONAL_ZERO, **settings}
    if "source_files" in old:          # the content decides; the path may differ (the data were moved or copied)
        old["source"] = now["source"]
    else:                               # a sidecar from before session 28 pinned the path only: nothing to compare
        old["source_files"] = now["source_files"]
    # Conversations are answered in input order, so a file made with max_samples = N is the prefix of one
    # made with more: a larger (or unlimited, 0) max_samples extends it instead of being refused.
    grows = old.get("max_samples", 0) != 0 and (settings["max_samples"] == 0 or
                                                 settings["max_samples"] > old.get("max_samples", 0))
    diff = {k: (old.get(k), now.get(k)) for k in {**old, **now}    # keys on either side: one the file has and
            if old.get(k) != now.get(k) and not (k == "max_samples" and grows)}   # this run lacks counts too
    if diff:
        lines = "; ".join(f"{k}: {_short(k, a)} in the file vs {_short(k, b)} now" for k, (a, b) in diff.items())
        raise ValidationError(f"{output} was generated with other settings ({lines})",
                              "rerun with the original settings to resume, or pass a new --output")
    return {**fresh, **state, "settings": settings}


def _short(key: str, value) -> str:
    """A setting as the refusal names it: the source's files as name (size bytes, sha256 prefix)."""
    if key == "source_files" and isinstance(value, list):
        return "[" + ", ".join(f"{f['name']} ({f['size']} bytes, sha256 {f['sha256'][:12]})" for f in value) + "]"
    return repr(value)
