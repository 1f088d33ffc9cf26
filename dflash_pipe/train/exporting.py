"""`dflash-pipe export`: a training checkpoint -> the z-lab format (config.json + model.safetensors).

Takes a training output directory (uses its newest *complete* checkpoint) or one checkpoint
directory. The drafter's shape comes from the checkpoint's state.json, so no cache or target is
needed. Training already exports its final weights to <output_dir>/export; this command exports
any earlier checkpoint the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafter import DFlashDrafter, DrafterModelConfig, export_drafter
from ..errors import CacheError
from .checkpoint import MARKER, complete_checkpoints, read_model_tensors, read_state


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if (path / MARKER).exists():
        return path
    ckpts = complete_checkpoints(path)
    if not ckpts:
        raise CacheError(f"{path}: no complete checkpoint (a ckpt-* directory with a {MARKER} marker)",
                         "point at a training --output-dir or one of its ckpt-* directories")
    return ckpts[-1]


def export_checkpoint(path: str | Path, out_dir: str | Path, *, with_modeling_code: bool = False) -> Path:
    ckpt = resolve_checkpoint(path)
    state = read_state(ckpt)  # a damaged state.json is a CacheError naming it, not a traceback
    cfg = DrafterModelConfig.from_dict(state["drafter_config"], where=f"{ckpt}/state.json drafter_config")
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to_empty(device="cpu")
    model.load_state_dict(read_model_tensors(ckpt), strict=True)
    return export_drafter(model, cfg, out_dir, with_modeling_code=with_modeling_code)
