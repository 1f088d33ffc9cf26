"""`dflash-pipe cache verify --recompute K`: rerun K cached samples through a plain HF forward.

The cached features came from packed forwards with hooks; the reference here is the plain,
unpacked `output_hidden_states[id + 1]` forward of each document alone (target/runner.py's
`standalone_features`), in the dtype the cache was extracted with. Cached values are bf16 (or fp8),
so the comparison tolerance is that codec's rounding, not float equality.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..cache import ShardReader, load_manifest
from ..dist import check_device
from ..errors import CacheError, UsageError

TOLERANCE = {"lossless": 2e-2, "fp8": 8e-2}  # relative L2 per document, above bf16 / e4m3 rounding


def check_recompute_args(k: int, device: str) -> None:
    """`cache verify --recompute K --device D`, checked before the cache is read or a target loads."""
    if k < 0:
        raise UsageError(f"--recompute must be >= 0 (the number of samples to rerun; 0 = none), got {k}")
    if k:
        check_device(device, "--device")


def recompute_check(cache_dir: str | Path, k: int, device: str = "auto", seed: int = 0) -> dict:
    from ..target.loading import load_target
    from ..target.runner import standalone_features

    check_recompute_args(k, device)
    man = load_manifest(cache_dir)
    t, f = man["target"], man["features"]
    spec = t.get("model_dir") if not str(t.get("model", "")).startswith(("embedded:", "random:")) else t["model"]
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = man["fingerprint_fields"]["target_dtype"]
    bundle = load_target(spec, device=dev, dtype=dtype, seed=int(t["identity"].get("seed", 0)))
    if bundle.identity.get("weights_fingerprint") != man["fingerprint_fields"]["weights_fingerprint"]:
        raise CacheError(f"{cache_dir}: the target loaded now ({spec}) has another weights fingerprint than the "
                         "one the cache was extracted from", "recompute on the machine/device type that extracted it")
    rows = []
    for e in man["shards"]:
        reader = ShardReader(e["abs_path"], expect_fingerprint=man["fingerprint"])
        for rg in range(reader.num_row_groups):
            rows += [(e["abs_path"], rg, r) for r in range(reader.row_group_rows(rg))]
    picks = random.Random(seed).sample(rows, min(k, len(rows)))
    tol = TOLERANCE[f["codec"]]
    results, worst = [], 0.0
    for path, rg, r in picks:
        row = ShardReader(path).read_row_group(rg)[r]
        ref = standalone_features(bundle, row.input_ids.long(), f["layer_ids"]).hidden_TD.float().cpu()
        got = row.hidden().float()
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        worst = max(worst, err)
        results.append({"sample_id": row.sample_id, "shard": Path(path).name, "row_group": rg, "tokens": row.num_tokens,
                        "rel_l2": err})
        if err > tol:
            raise CacheError(f"{Path(path).name}: row group {rg}, row {r} (sample {row.sample_id}), field hidden: "
                             f"features differ from a fresh standalone forward by {err:.3g} (tolerance {tol})",
                             "the cache does not match its target; re-extract it")
    return {"samples": len(results), "max_rel_l2": worst, "tolerance": tol, "details": results}
