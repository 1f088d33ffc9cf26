"""Building blocks of stage 2, each built from the cache spec and the run config.

The trainer builds them in a fixed order: drafter config (validated against the cache), frozen
target head, drafter, optimizer + schedule. Nothing here loads the target model: stage 2 reads
only ``target_head.safetensors`` (embeddings + lm_head) from the cache directory.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ..config import RunConfig
from ..drafter import DFlashDrafter, DrafterModelConfig, derive_drafter_config
from ..errors import CacheError, ValidationError
from ..io_utils import safe_child


def target_cfg_dict(spec: dict) -> dict:
    t = spec["target"]
    c = t.get("config", {})
    return {"family": t.get("family"), "hidden_size": t["hidden_size"], "vocab_size": t["vocab_size"],
            "num_layers": t["num_layers"], "num_attention_heads": c.get("num_attention_heads"),
            "num_key_value_heads": c.get("num_key_value_heads"), "intermediate_size": c.get("intermediate_size"),
            "rope_theta": c.get("rope_theta"), "max_position_embeddings": c.get("max_position_embeddings")}


def build_drafter_config(cfg: RunConfig, spec: dict, device: torch.device) -> DrafterModelConfig:
    # The last target layer is refused unless extract was told it is fine (recorded in the spec) or the
    # manifest says so now: a cache made before that check existed may use it.
    from ..target.layers import check_servable

    allowed = cfg.extract.allow_unservable_layers or bool((spec.get("extract") or {}).get("allow_unservable_layers"))
    check_servable(spec["features"]["layer_ids"], spec["target"]["num_layers"], allowed,
                   "set allow_unservable_layers = true in the manifest's [extract] section (extract records "
                   "it in the cache when run with --allow-unservable-layers)")
    d = dataclasses.asdict(cfg.drafter)
    unused = (spec["target"].get("unused_embedding_row") or [None])[0]
    return derive_drafter_config(target_cfg_dict(spec), target_layer_ids=spec["features"]["layer_ids"],
                                 unused_embedding_row=unused, device_type=device.type, **d)


def check_against_cache(dcfg: DrafterModelConfig, spec: dict, where: str) -> None:
    """Refuse a drafter (e.g. from a checkpoint) that does not fit this cache, naming the fields."""
    f, t = spec["features"], spec["target"]
    expect = {"hidden_size": f["hidden_size"], "target_layer_ids": list(f["layer_ids"]),
              "num_target_layers": t["num_layers"], "vocab_size": t["vocab_size"]}
    diff = {k: (getattr(dcfg, k), v) for k, v in expect.items() if getattr(dcfg, k) != v}
    if not 0 <= dcfg.mask_token_id < t["vocab_size"]:
        diff["mask_token_id"] = (dcfg.mask_token_id, f"< {t['vocab_size']}")
    if diff:
        lines = "; ".join(f"{k}: drafter {a!r} vs cache {b!r}" for k, (a, b) in diff.items())
        raise ValidationError(f"{where} does not match the cache: {lines}",
                              "train a new drafter for this cache (new --output-dir), or use the matching cache")


def drafter_shape_diff(saved: dict, dcfg: DrafterModelConfig, saved_label: str, now_label: str,
                       ignore: tuple[str, ...] = ("attention",)) -> str:
    """'field: <saved_label> a vs <now_label> b; ...' for each field of `dcfg` that `saved` (a drafter config
    dict) holds otherwise; '' when they match. The attention path is a runtime choice, not part of the shape."""
    now = {k: v for k, v in dcfg.to_dict().items() if k not in ignore}
    return "; ".join(f"{k}: {saved_label} {saved.get(k)!r} vs {now_label} {v!r}"
                     for k, v in now.items() if saved.get(k) != v)


def check_resume_identity(state: dict, spec: dict, path: Path, dcfg: DrafterModelConfig | None = None,
                          shards: list[int] | None = None) -> None:
    """Refuse to resume a checkpoint trained on another cache, another shard subset or drafter shape."""
    if state.get("train_shards") != shards:  # the saved data position indexes that subset's schedule
        raise ValidationError(f"checkpoint {path} was trained on shards {state.get('train_shards') or 'all'}, "
                              f"this run asks for {shards or 'all'}",
                              "resume with the original --shards, or pass --resume never / a new --output-dir")
    old = state.get("cache_identity", {})
    new = cache_identity(spec)
    diff = {k: (old.get(k), new[k]) for k in new if old.get(k) != new[k]}
    if dcfg is not None and not diff:
        shape = drafter_shape_diff(state.get("drafter_config", {}), dcfg, "checkpoint", "now")
        if shape:
            raise ValidationError(f"checkpoint {path} has another drafter shape: {shape}",
                                  "use a new --output-dir for a new drafter, or --resume never")
    if diff:
        lines = "; ".join(f"{k}: checkpoint {a!r} vs cache {b!r}" for k, (a, b) in diff.items())
        raise ValidationError(f"checkpoint {path} was trained on a different cache: {lines}",
                              "resume with the original --cache-dir, or pass --resume never / a new --output-dir")


def cache_identity(spec: dict) -> dict:
    """What a checkpoint remembers of its cache (a mismatch on resume is refused)."""
    ff = spec["fingerprint_fields"]
    return {"tokenizer_hash": ff.get("tokenizer_hash"), "layer_ids": ff.get("layer_ids"),
            "layer_convention": ff.get("layer_convention"), "weights_fingerprint": ff.get("weights_fingerprint"),
            "hidden_size": spec["features"]["hidden_size"]}


class FrozenHead:
    """The target's embedding rows (on the CPU: blocks only need anchor + MASK rows) and lm_head."""

    def __init__(self, cache_dir, head_file: str, device: torch.device, dtype: torch.dtype,
                 scratch: Path | None = None):
        """`cache_dir`: a path or a cache URI; a head file on object storage is downloaded into `scratch`."""
        from ..cache.fs import open_cache_fs

        fs = open_cache_fs(cache_dir)
        what = f"{fs.uri}/cache_spec.json field features.head_file"
        if fs.is_local:
            path = safe_child(fs.root, head_file, what)
        else:
            fs.child(head_file, what)  # refuses absolute paths and escapes
            try:
                path = fs.fetch_to_local(head_file, Path(scratch or "."))
            except FileNotFoundError:
                path = fs.display(head_file)
        if not Path(path).exists():
            raise CacheError(f"{path} is missing: stage 2 needs the target's embeddings and lm_head",
                             "rerun `dflash-pipe extract` on this cache (it rewrites the head file)")
        from ..target.heads import read_embeddings_and_head

        heads = read_embeddings_and_head(path)  # reads only these tensors; handles tied heads
        self.embed_VH = heads.embed_VH.to(torch.float32)
        self._mask_rows: dict[int, torch.Tensor] = {}   # the MASK token's row, on the device

        self.lm_head_VH = heads.lm_head_VH.to(device=device, dtype=dtype)
        self.lm_head_VH.requires_grad_(False)
        self.device = device

    def block_embeds(self, anchor_tokens_N: torch.Tensor, mask_token_id: int, block_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
        """[N*B, H]: each block is [embed(anchor token), embed(MASK) x (B-1)] (`block_embeds` below)."""
        return block_embeds(self.embed_VH, self._mask_rows, anchor_tokens_N, mask_token_id, block_size, dtype,
                            self.device)


def block_embeds(embed_VH: torch.Tensor, mask_rows: dict, anchor_tokens_N: torch.Tensor, mask_token_id: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N*B, H] on `device`: each block is [embed(anchor token), embed(MASK) x (B-1)]; `mask_rows` caches the MASK
    row on the device.

    The table stays in host memory (5 GB in fp32 at the seed's vocabulary), so the N anchor rows are gathered
    there, into pinned memory on CUDA, and only they cross; the blocks are put together on the device. Until
    session 26 the whole [N*B, H] block tensor crossed from pageable memory (19 MB a step for SmolLM2, 168 MB at
    the seed's size), and a copy from pageable memory makes the step's stream wait for everything queued
    before it: the host could not run ahead of the GPU into the next step."""
    idx = anchor_tokens_N.cpu()
    n, h = idx.shape[0], embed_VH.shape[1]
    if device.type == "cuda":
        pinned = torch.empty((n, h), dtype=embed_VH.dtype, pin_memory=True)
        torch.index_select(embed_VH, 0, idx, out=pinned)
        anchor = pinned.to(device, non_blocking=True)  # the pinned block is reused once this copy is done
    else:
        anchor = embed_VH[idx]
    mask = mask_rows.get(mask_token_id)
    if mask is None:
        mask = mask_rows[mask_token_id] = embed_VH[mask_token_id].to(device)
    blocks = torch.cat([anchor[:, None, :], mask.expand(n, block_size - 1, h)], dim=1)
    return blocks.reshape(n * block_size, h).to(dtype)


def init_state_from_export(export_dir: str, dcfg: DrafterModelConfig) -> dict[str, torch.Tensor]:
    """`--init-from`: an earlier export's weights (safetensors), refused unless its drafter has this run's shape."""
    from ..drafter import load_exported_drafter  # noqa: PLC0415 (export pulls in the HF-facing code)

    model, theirs = load_exported_drafter(export_dir)  # fp32 on the CPU
    # an export's config may lack the last two (z-lab's): defaults then, and neither changes what the weights mean
    diff = drafter_shape_diff(theirs.to_dict(), dcfg, "export", "this run",
                              ignore=("attention", "max_position_embeddings", "initializer_range"))
    if diff:
        raise ValidationError(f"--init-from {export_dir}: the exported drafter differs from this run's: {diff}",
                              "give this run the export's drafter settings (e.g. --drafter-num-layers), or drop "
                              "--init-from")
    return model.state_dict()


def build_model(dcfg: DrafterModelConfig, device: torch.device, seed: int, compile_layers: bool,
                checkpoint_mlp_layers: int = 0, init_state: dict[str, torch.Tensor] | None = None) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(dcfg).to(device=device, dtype=torch.float32)
    if init_state is not None:  # before compiling: compiled layers rename their parameters
        model.load_state_dict(init_state, strict=True)
    for layer in list(model.layers)[:checkpoint_mlp_layers]:
        layer.checkpoint_mlp = True
    if compile_layers:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, dynamic=False)
    return model


def resolve_param_dtype(cfg: RunConfig, precision: str) -> torch.dtype:
    """dtype of the draft Linear weights (see master_weights.py); bf16 weights need bf16 autocast."""
    p = cfg.train.param_dtype
    if p == "bf16" and precision != "bf16":
        raise ValidationError(f"--param-dtype bf16 needs bf16 autocast, but precision is {precision}",
                              "pass --precision bf16, or --param-dtype fp32 / auto")
    return torch.bfloat16 if (p == "bf16" or (p == "auto" and precision == "bf16")) else torch.float32


def build_optimizer(params: list[torch.Tensor], cfg: RunConfig, device: torch.device, total_steps: int,
                    lr_factor=None):
    """AdamW over `params` (the fp32 masters) + the warmup/cosine schedule over `total_steps` steps, or
    `lr_factor(step)` (window mode's curve over shard passes, window_lr.py)."""
    tr = cfg.train
    kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(params, lr=tr.lr, betas=(0.9, 0.95), weight_decay=tr.weight_decay, **kwargs)
    warm = max(1, int(round(tr.warmup_frac * total_steps))) if tr.warmup_frac > 0 else 0

    def step_cosine(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return tr.min_lr_frac + (1 - tr.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, step_cosine if lr_factor is None else lr_factor)
    return opt, sched
