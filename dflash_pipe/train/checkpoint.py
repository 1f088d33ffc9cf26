"""Training checkpoints: safetensors + JSON (no pickle), complete or invisible.

A checkpoint is a directory ``ckpt-<step>`` holding
    model.safetensors       fp32 master weights (drafter parameter names; see master_weights.py)
    optimizer.safetensors   AdamW state tensors, keyed ``<param name>.<state key>``
    state.json              step, epoch, data position, scheduler, configs, cache fingerprint
    COMPLETE                written last
It is built as a hidden temp directory and renamed into place after every file (and the marker)
is fsynced, so a SIGKILL at any moment leaves either the previous checkpoints or the new one.
Loading considers only directories with the marker; the newest wins.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..drafter.export import plain_name
from ..errors import CacheError
from ..faults import fault_point
from ..io_utils import disk_error, atomic_write_json, fsync_dir, fsync_path, os_error_of, temp_path_for
from .master_weights import MasterWeights

MARKER = "COMPLETE"
PREFIX = "ckpt-"


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, dict]:
    """Split an optimizer state dict into tensors (safetensors) and JSON scalars."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        name = names[idx]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{name}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{name}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, names: dict[int, str], path: Path, meta: dict,
                   device: torch.device) -> None:
    sd = opt.state_dict()
    state = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for idx in range(len(names)):
            name = names[idx]
            entry = {}
            # plain_name: checkpoints written before the names were plain carry compiled layers' `_orig_mod.`
            for key in [k for k in keys if plain_name(k.rsplit(".", 1)[0]) == name]:
                t = f.get_tensor(key)
                sub = key.rsplit(".", 1)[1]
                entry[sub] = t if sub == "step" else t.to(device)
            for key, v in meta["scalars"].items():
                if plain_name(key.rsplit(".", 1)[0]) == name:
                    entry[key.rsplit(".", 1)[1]] = v
            if entry:
                state[idx] = entry
    sd["state"] = state
    sd["param_groups"] = meta["param_groups"]
    opt.load_state_dict(sd)


def snapshot(weights: MasterWeights, opt: torch.optim.Optimizer, copy: bool = False) -> tuple[dict, dict, dict]:
    """(model tensors, optimizer tensors, optimizer JSON meta) on the host. `copy=True` clones tensors that
    are already on the host, so the step loop may keep updating them while a background thread writes."""
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return (t.clone() if copy and t.device.type == "cpu" else t.cpu()).contiguous()

    model = {n: host(p) for n, p in weights.master_state().items()}
    opt_tensors, opt_meta = optimizer_tensors(opt, dict(enumerate(weights.names)))  # the optimizer's order
    if copy and all(p.device.type == "cpu" for p in weights.masters):  # .cpu() of a host tensor is the tensor itself: the next optimizer step would change it
        opt_tensors = {k: v.clone() for k, v in opt_tensors.items()}
        opt_meta = json.loads(json.dumps(opt_meta))  # detached from the live param groups
    return model, opt_tensors, opt_meta


def save_checkpoint(out_dir: str | Path, step: int, weights: MasterWeights, opt: torch.optim.Optimizer,
                    state: dict, keep: int = 2) -> Path:
    return write_snapshot(out_dir, step, snapshot(weights, opt), state, keep)


def write_snapshot(out_dir: str | Path, step: int, snap: tuple[dict, dict, dict], state: dict, keep: int = 2) -> Path:
    """Write one checkpoint from a host snapshot: temp dir, fsync, COMPLETE marker, rename (any thread)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{PREFIX}{step:08d}"
    tmp = temp_path_for(final)
    model_tensors, opt_tensors, opt_meta = snap
    try:
        tmp.mkdir()
        save_file(model_tensors, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta}, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            fsync_path(f)
        fault_point("train.checkpoint.before_marker")
        sizes = {f.name: f.stat().st_size for f in tmp.iterdir()}
        (tmp / MARKER).write_text(json.dumps({"step": step, "file_bytes": sizes}, sort_keys=True) + "\n")
        fsync_path(tmp / MARKER)
        fsync_dir(tmp)
        fault_point("train.checkpoint.before_rename")
        if final.exists():  # the same step again (a rerun that trained nothing, a round boundary after a periodic
            # checkpoint): the complete one steps aside by a rename, never deleted before its successor is in
            # place; a kill between the two renames leaves it complete under the hidden name (find_resume renames
            # it back)
            old = replaced_path(final)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            fault_point("train.checkpoint.between_renames")
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_exc = os_error_of(exc)  # OSError, or safetensors' SafetensorError "... (os error 28)"
        if os_exc is not None:
            raise disk_error(os_exc, final, "writing checkpoint") from exc
        raise
    prune(out_dir, keep)
    atomic_write_json(out_dir / "latest.json", {"checkpoint": final.name, "step": step})
    return final


def replaced_path(final: Path) -> Path:
    """Where a complete checkpoint waits while its step is written again (hidden: prune's leftovers)."""
    return final.parent / f".{final.name}.replaced"


def restore_replaced(out_dir: Path) -> None:
    """A writer killed between its two renames left a step's complete checkpoint under the hidden name and none
    under its own: put it back (the new one's temp dir is a leftover that prune removes)."""
    for p in out_dir.glob(f".{PREFIX}*.replaced"):
        final = out_dir / p.name[1:-len(".replaced")]
        if (p / MARKER).exists() and not final.exists():
            try:
                os.replace(p, final)
            except OSError:  # another rank of this run put it back first
                pass


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def prune(out_dir: Path, keep: int) -> None:
    for p in out_dir.iterdir():  # leftovers of killed writers
        if p.is_dir() and p.name.startswith(f".{PREFIX}"):
            shutil.rmtree(p, ignore_errors=True)
    ckpts = complete_checkpoints(out_dir)
    for p in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def find_resume(out_dir: str | Path, resume: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        restore_replaced(Path(out_dir))   # (a missing dir globs to nothing)
        ckpts = complete_checkpoints(out_dir)
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not (path / MARKER).exists():
        raise CacheError(f"checkpoint {path} is not complete (no {MARKER} marker)",
                         "pass --resume auto to take the newest complete checkpoint")
    return path


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"{path}/state.json: unreadable ({exc})", "pass --resume never or another checkpoint") from None


def check_files(path: Path) -> None:
    """The sizes the COMPLETE marker recorded against the files (markers of older checkpoints hold only the step)."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    recorded = marker.get("file_bytes", {}) if isinstance(marker, dict) else {}
    for name, size in recorded.items():
        f = path / name
        have = f.stat().st_size if f.exists() else None
        if have != size:
            raise CacheError(f"checkpoint {path} is damaged: {name} is {have if have is not None else 'missing'} "
                             f"bytes, its {MARKER} marker recorded {size}", damaged_hint(path))


def damaged_hint(path: Path) -> str:
    return (f"delete {path} (rm -r) and rerun with --resume auto to continue from the previous complete checkpoint, "
            "or pass --resume never to start afresh")


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's fp32 master weights by the drafter's own parameter names (checkpoints written before session
    24's fix carry compiled layers' `layers.i._orig_mod.` names: plain_name drops them)."""
    with safe_open(str(path / "model.safetensors"), framework="pt", device="cpu") as f:
        return {plain_name(k): f.get_tensor(k) for k in f.keys()}


def load_checkpoint(path: Path, weights: MasterWeights, opt: torch.optim.Optimizer, device: torch.device) -> dict:
    """Weights + optimizer state from a complete checkpoint; a damaged one is a CacheError (exit 3) naming it."""
    check_files(path)
    state = read_state(path)
    try:
        weights.load_master_state(read_model_tensors(path))
        names = dict(enumerate(weights.names))
        load_optimizer(opt, names, path / "optimizer.safetensors", state["optimizer"], device)
    except CacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError, a truncated header, wrong keys/shapes
        raise CacheError(f"checkpoint {path} is damaged: {type(exc).__name__}: {str(exc)[:200]}",
                         damaged_hint(path)) from None
    return state
