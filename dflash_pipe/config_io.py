"""Run manifests in and out: TOML loading with typed checks, command-line overrides, the resolved config written
next to every output, and the checks that involve several fields (`normalize`). The sections are the dataclasses in
config.py."""

from __future__ import annotations

import json
import tomllib
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import (DataConfig, DrafterConfig, EvalConfig, ExtractConfig, RunConfig, TargetConfig,
                     TrainConfig)
from .errors import UsageError

_SECTION_TYPES = {"target": TargetConfig, "data": DataConfig, "extract": ExtractConfig,
                  "drafter": DrafterConfig, "train": TrainConfig, "eval": EvalConfig}


def field_type(section: str, key: str) -> type:
    hints = typing.get_type_hints(_SECTION_TYPES[section])
    return hints[key]


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a TOML value (or a CLI string) to the field's declared type."""
    origin = typing.get_origin(typ)
    if origin is list:
        (elem,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(",")) if v]
        if not isinstance(value, list):
            raise UsageError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, elem, where) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise UsageError(f"{where}: expected true/false, got {value!r}")
    if typ in (int, float):  # a TOML number or a CLI string; a bool is neither, a float is no integer
        allowed, what = ((int, str), "an integer") if typ is int else ((int, float, str), "a number")
        try:
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ValueError
            return typ(value)
        except ValueError:
            raise UsageError(f"{where}: expected {what}, got {value!r}") from None
    if typ is str:
        if not isinstance(value, str):
            raise UsageError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {typ}")


def _set(cfg: RunConfig, section: str, key: str, value: Any, where: str) -> None:
    sect = getattr(cfg, section)
    known = {f.name: f for f in fields(sect)}
    if key not in known:
        close = [k for k in known if k.startswith(key[:3])]
        hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(known)}"
        raise UsageError(f"{where}: unknown key '{key}' in [{section}]", hint)
    value = _coerce(value, field_type(section, key), where)
    choices = known[key].metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"{where}: '{value}' is not one of {', '.join(choices)}")
    setattr(sect, key, value)


def load_manifest(path: str | Path | None) -> RunConfig:
    """Read a TOML run manifest; refuse unknown sections/keys and mistyped values."""
    cfg = RunConfig()
    if path is None:
        return cfg
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))   # a byte-order mark is skipped, as the readers do
    except FileNotFoundError:
        raise UsageError(f"run manifest {path} does not exist", "pass --manifest with an existing .toml file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})", "save the manifest as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    for section, table in raw.items():
        if section not in _SECTION_TYPES:
            raise UsageError(f"{path}: unknown section [{section}]", f"sections are {', '.join(_SECTION_TYPES)}")
        if not isinstance(table, dict):
            raise UsageError(f"{path}: '{section}' must be a table ([{section}])")
        for key, value in table.items():
            _set(cfg, section, key, value, f"{path}: [{section}] {key}")
    cfg.source = str(path)
    return cfg


def apply_overrides(cfg: RunConfig, overrides: dict[tuple[str, str], Any], flag_of=None) -> RunConfig:
    """Apply command-line values ({(section, key): value}); None means 'not given'."""
    for (section, key), value in overrides.items():
        if value is None:
            continue
        flag = flag_of(section, key) if flag_of else f"{section}.{key}"
        _set(cfg, section, key, value, f"flag {flag}")
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):   # TOML basic string: non-ASCII as itself (JSON's surrogate pairs are not TOML), DEL escaped
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(cfg: RunConfig) -> str:
    lines = [f"# resolved dflash-pipe config (from {cfg.source})"]
    for section in _SECTION_TYPES:
        lines.append(f"\n[{section}]")
        for f in fields(getattr(cfg, section)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
    return "\n".join(lines) + "\n"


def write_resolved(cfg: RunConfig, out_dir: str | Path) -> Path | str:
    from .cache.fs import is_remote, open_cache_fs
    from .io_utils import atomic_write_text

    if is_remote(out_dir):  # a cache on object storage
        fs = open_cache_fs(out_dir)
        fs.write_bytes("resolved_config.toml", to_toml(cfg).encode("utf-8"))
        return fs.display("resolved_config.toml")
    out = open_cache_fs(out_dir).root / "resolved_config.toml"  # a path or file://
    atomic_write_text(out, to_toml(cfg))
    return out


def parse_shard_subset(spec: str, num_shards: int) -> list[int]:
    """'0-3,7' -> [0,1,2,3,7]; '' -> all shards. Refuses indices outside [0, num_shards)."""
    if not spec.strip():
        return list(range(num_shards))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise UsageError(f"flag --shards: range '{part}' is reversed", f"use {hi}-{lo}")
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"flag --shards: cannot parse '{part}' (use e.g. 0-3,7)") from None
    bad = [i for i in out if not 0 <= i < num_shards]
    if bad:
        raise UsageError(f"flag --shards: shard {bad[0]} is outside 0..{num_shards - 1}",
                         "raise --num-shards or fix the subset")
    return sorted(out)


def normalize(cfg: RunConfig) -> RunConfig:
    """Resolve shorthands and check rules that involve several fields (errors name the flag)."""
    ex, tr, dr = cfg.extract, cfg.train, cfg.drafter
    if ex.shards.strip().isdigit():  # `--shards 8` is shorthand for --num-shards 8
        if int(ex.shards) < 1:
            raise UsageError(f"{cfg.source}: --shards {ex.shards}: a plain integer is the shard count",
                             "to run only shard 0 pass --shards 0-0")
        ex.num_shards, ex.shards = int(ex.shards), ""
    checks = [
        (ex.num_shards >= 1, "--num-shards must be >= 1"),
        (ex.max_length >= 2, "--max-length must be >= 2"),
        (ex.token_budget >= ex.max_length, f"--token-budget ({ex.token_budget}) must be >= --max-length "
                                           f"({ex.max_length}): a document must fit in one packed forward"),
        (ex.topk >= 0, "--topk must be >= 0"),
        (ex.row_group_mb >= 1, "--row-group-mb must be >= 1"),
        (ex.num_target_layers >= 1, "--num-target-layers must be >= 1"),
        (dr.block_size >= 2, "--drafter-block-size must be >= 2"),
        (dr.num_layers >= 1, "--drafter-num-layers must be >= 1"),
        (tr.num_anchors >= 1, "--num-anchors must be >= 1"),
        (tr.copy_anchor_weight >= 0, "--copy-anchor-weight must be >= 0"),
        (tr.context_tokens >= 2, "--context-tokens must be >= 2"),
        (tr.lr > 0, "--lr must be > 0"),
        (0 <= tr.warmup_frac < 1, "--warmup-frac must be in [0, 1)"),
        (0 <= tr.kd_weight <= 1, "--kd-weight must be in [0, 1]"),
        (tr.loss_chunk_tokens >= 1, "--loss-chunk-tokens must be >= 1"),
        (tr.val_every >= 1 and tr.val_batches >= 1, "--val-every and --val-batches must be >= 1"),
        (tr.epochs >= 1 or tr.passes_per_shard > 0, "--epochs must be >= 1 (the window mode, --passes-per-shard, "
                                                    "counts passes instead)"),
        (tr.max_steps >= 0, "--max-steps must be >= 0 (0: no cap)"),
        (ex.max_cache_gib >= 0, "--max-cache-gib must be >= 0"),
        (ex.space_wait_timeout_s > 0 and tr.follow_timeout_s > 0, "--space-wait-timeout-s and --follow-timeout-s "
                                                                  "must be > 0"),
        (tr.passes_per_shard >= 0, "--passes-per-shard must be >= 0"),
        ("heldout" not in cfg.eval.prompts.replace("_", "").replace("-", "").lower() or cfg.data.skip_samples > 0,
         "[eval] prompts asks for the 'heldout' set (the first data.skip_samples conversations, never trained on) "
         "but --data-skip-samples is 0: set it > 0 (extraction then skips those) or drop 'heldout'"),
        (tr.window_checkpoint_rounds >= 1, "--window-checkpoint-rounds must be >= 1"),
        (tr.loader_workers >= 1 and tr.loader_prefetch >= 1, "--loader-workers and --loader-prefetch must be >= 1"),
        (not (dr.attention == "sdpa-grouped" and tr.compile == "on"),
         "--drafter-attention sdpa-grouped runs eagerly (its key width changes every step, so compiled layers would "
         "recompile until the lock stops them): use --compile off (auto is off for it), or --drafter-attention flex "
         "with --compile on"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(f"{cfg.source}: {message}")
    if ex.shards:
        parse_shard_subset(ex.shards, ex.num_shards)
    if tr.profile_steps:
        from .train.step_profile import parse_profile_steps
        parse_profile_steps(tr.profile_steps)
    return cfg
