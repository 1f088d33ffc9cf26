"""Turn the config dataclasses into typer options, so field docs are the --help text.

A command declares which config sections it exposes. Fields of its *own* section get bare flags
(``train --lr``), fields of the other sections are prefixed (``train --drafter-num-layers``).
Every option defaults to None = "keep the manifest's value"; given values are applied with
`apply_overrides`, whose errors name the flag.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional

import typer

from .config import _SECTION_TYPES, apply_overrides, field_type, load_manifest, normalize

MANIFEST_HELP = "Run manifest (TOML) with [target], [data], [extract], [drafter], [train], [eval] sections."


def flag_name(section: str, key: str, own: tuple[str, ...]) -> str:
    base = key.replace("_", "-")
    return f"--{base}" if section in own else f"--{section}-{base}"


def _cli_type(typ) -> type:
    if typing.get_origin(typ) is list:
        return str  # comma-separated
    return typ


def config_command(app: typer.Typer, name: str, own: tuple[str, ...], others: tuple[str, ...] = (),
                   help: str | None = None) -> Callable:
    """Decorator: `func(cfg: RunConfig, **extra)` becomes a typer command with config flags."""

    def decorator(func: Callable) -> Callable:
        hints = typing.get_type_hints(func)  # resolve string annotations (from __future__ import annotations)
        extra_params = [p.replace(annotation=hints.get(p.name, p.annotation))
                        for p in list(inspect.signature(func).parameters.values())[1:]]
        params = [inspect.Parameter("manifest", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                    default=typer.Option(None, "--manifest", "-m", help=MANIFEST_HELP))]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra_params]
        mapping: dict[str, tuple[str, str]] = {}
        seen: set[str] = {"--manifest"}
        for section in own + others:
            for f in fields(_SECTION_TYPES[section]):
                flag = flag_name(section, f.name, own)
                if flag in seen:
                    flag = f"--{section}-{f.name.replace('_', '-')}"
                seen.add(flag)
                typ = _cli_type(field_type(section, f.name))
                decl = f"{flag}/--no-{flag[2:]}" if typ is bool else flag
                helptext = f.metadata.get("help", "")
                if f.metadata.get("choices"):
                    helptext += f" [{'|'.join(f.metadata['choices'])}]"
                pname = f"{section}__{f.name}"
                mapping[pname] = (section, f.name)
                params.append(inspect.Parameter(
                    pname, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[typ],
                    default=typer.Option(None, decl, help=helptext, show_default=False,
                                         rich_help_panel=f"{section} settings")))

        def wrapper(**kwargs):
            manifest = kwargs.pop("manifest")
            overrides = {mapping[k]: kwargs.pop(k) for k in list(kwargs) if k in mapping}
            cfg = load_manifest(manifest)
            apply_overrides(cfg, overrides, lambda s, k: flag_name(s, k, own))
            normalize(cfg)
            return func(cfg, **kwargs)

        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__doc__ = func.__doc__
        wrapper.__name__ = func.__name__
        app.command(name, help=help or func.__doc__)(wrapper)
        return func

    return decorator

