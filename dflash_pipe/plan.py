"""`dflash-pipe plan`: what a pipeline run would do, and why stage 1 is or is not needed.

Stage 1 is decided by comparing the fingerprint this manifest would produce with the cache on
disk, without loading the target's weights (weights are fingerprinted from safetensors headers
and samples, see target/fingerprint.py):
  run     no cache yet
  resume  same fingerprint, some shards missing (extract skips the committed ones)
  skip    same fingerprint, manifest complete
  refuse  different fingerprint: the differing fields are listed; new cache dir or --overwrite
Random-weight targets are fingerprinted from their tensors, which differ per device, so for
them stage 1 always runs and decides itself (it skips committed shards if nothing changed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import load_manifest, load_spec
from .cache.budget import GIB
from .cache.fs import CacheFS, open_cache_fs
from .cache.manifest import MANIFEST_FILE, SPEC_FILE, committed_shards, diff_fields, fingerprint_of
from .cache.verify import head_file_damage
from .cache.window import consumed_indices, load_ledgers
from .config import RunConfig
from .dist import check_device
from .errors import CacheError, UsageError
from .extract.fingerprint import fingerprint_fields, resolve_target_dtype


@dataclass
class Plan:
    cfg: RunConfig
    stage1: str
    reason: str
    device: str
    fingerprint: str | None = None
    differing: dict = field(default_factory=dict)
    target_line: str = ""
    layer_ids: list[int] = field(default_factory=list)
    committed: int = 0
    window: dict = field(default_factory=dict)  # window mode / disk budget (see window_plan)

    def to_json(self) -> str:
        return json.dumps({"stage1": self.stage1, "reason": self.reason, "fingerprint": self.fingerprint,
                           "cache_dir": self.cfg.extract.cache_dir, "num_shards": self.cfg.extract.num_shards,
                           "committed_shards": self.committed, "layer_ids": self.layer_ids, "window": self.window,
                           "differing": {k: list(v) for k, v in self.differing.items()},
                           "summary": self.describe()}, default=str)

    def describe(self) -> str:
        c = self.cfg
        gpus_e, gpus_t = os.environ.get("EXTRACT_GPUS", "0,1"), os.environ.get("TRAIN_GPUS", "2,3")
        on_gpu = self.device.startswith("cuda")
        lines = [f"dflash-pipe plan ({c.source})",
                 f"  target    {self.target_line}",
                 f"  layers    {self.layer_ids or '(decided when the target is loaded)'}",
                 f"  data      {c.data.source} (format {c.data.format}, skip {c.data.skip_samples}, "
                 f"max {c.data.max_samples or 'all'}), max length {c.extract.max_length}",
                 f"  cache     {c.extract.cache_dir}: {c.extract.num_shards} shards, codec {c.extract.codec}, "
                 f"top-k {c.extract.topk}" + (f", fingerprint {self.fingerprint[:16]}" if self.fingerprint else ""),
                 f"  stage 1   {self.stage1.upper()}: {self.reason}"
                 + (f"  [torchrun on GPUs {gpus_e}]" if on_gpu else "  [CPU]")]
        for k, (old, new) in self.differing.items():
            lines.append(f"              {k}: cache {old!r} -> manifest {new!r}")
        ckpt_dir = Path(c.train.output_dir)
        ckpts = sorted(ckpt_dir.glob("ckpt-*/COMPLETE")) if ckpt_dir.is_dir() else []
        resume = f"resume from {ckpts[-1].parent.name}" if ckpts and c.train.resume == "auto" else "from scratch"
        lines.append(f"  stage 2   train {c.drafter.num_layers}-layer drafter (block {c.drafter.block_size}) on "
                     f"{c.train_cache_dir}, {c.train.epochs} epoch(s), context {c.train.context_tokens}, "
                     f"{c.train.num_anchors} anchors, {resume} -> {c.train.output_dir}"
                     + (f"  [DDP on GPUs {gpus_t}]" if on_gpu else "  [CPU]"))
        if self.window:
            w = self.window
            lines.append(f"  window    {w['summary']}")
        lines.append(f"  eval      {c.eval.prompts} (max {c.eval.max_prompts or 'all'} prompts, "
                     f"{c.eval.max_new_tokens} new tokens)")
        return "\n".join(lines)


def _dir_identity(model_dir: Path, trust_remote_code: bool) -> tuple[dict, dict]:
    from transformers import AutoTokenizer

    from .target.fingerprint import chat_template_hash, config_file_hash, safetensors_files, tokenizer_hash
    from .target.fingerprint import weights_fingerprint_files

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code)
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return ({"weights_fingerprint": weights_fingerprint_files(safetensors_files(model_dir)),
             "config_hash": config_file_hash(model_dir / "config.json"), "tokenizer_hash": tokenizer_hash(tok),
             "chat_template_hash": chat_template_hash(tok)}, text)


def window_plan(cfg: RunConfig, cache_dir: CacheFS, spec: dict | None) -> dict:
    """Budget, K, window size and expected disk high-water mark (shard sizes from committed sidecars)."""
    K, budget = cfg.train.passes_per_shard, cfg.extract.max_cache_gib
    if K <= 0 and budget <= 0:
        return {}
    n = cfg.extract.num_shards
    sides = []
    if spec is not None:
        for name in sorted(cache_dir.list_sizes()):
            if not (name.startswith("shard-") and name.endswith(".json")):
                continue
            try:
                sides.append(json.loads(cache_dir.read_bytes(name).decode("utf-8")))
            except (OSError, ValueError):
                continue
    big = max((int(s.get("bytes", 0)) for s in sides), default=0)
    tok = max((int(s.get("tokens", 0)) for s in sides), default=0)
    out = {"max_cache_gib": budget, "passes_per_shard": K, "num_shards": n, "window_shards": K,
           "shard_bytes_max": big or None, "shard_tokens_max": tok or None}
    if K <= 0:
        out["summary"] = (f"budget {budget:g} GiB but --passes-per-shard 0: nothing deletes shards, so extraction "
                          "stops (exit 4) once the budget is full")
        return out
    M = cfg.train.window_checkpoint_rounds
    need = (K + M) * big  # the trainer holds up to K + M - 1 shards, one more is being written
    # extraction runs ahead as far as the budget lets it: whole shards up to the budget, else the whole cache
    high = (int(budget * GIB) // big) * big if budget and big else big * n
    out |= {"min_budget_gib": need / GIB if big else None, "expected_high_water_gib": high / GIB if big else None}
    size = (f"shards up to {big / GIB:.3g} GiB / {tok:,} tokens: window ~{K * tok:,} tokens, needs >= "
            f"{need / GIB:.3g} GiB, expected high-water {high / GIB:.3g} GiB" if big else
            "shard size unknown until the first shard is committed (the budget must hold K + M shards)")
    room = f"{budget:g} GiB" if budget else "off (extraction runs ahead)"
    out["summary"] = (f"train --follow reads every shard {K} times in {n + K - 1} rounds (window of {K} shards, "
                      f"checkpoint every {M} round(s), + 1 being written); budget {room}; " + size)
    return out


def extract_repairs(cache_dir: CacheFS, spec: dict) -> list[str]:
    """What a rerun of extract rewrites in a cache whose shards are all committed, which stage 2 cannot read
    as it is: a missing or damaged target head file (extract rewrites one that is absent or fails
    head_file_damage: its header does not parse or the file size disagrees with it), a manifest.json that does not load
    or names another fingerprint (extract merges it again from the shard sidecars). Empty: nothing to mend."""
    out = []
    head = spec.get("features", {}).get("head_file")
    if head and not cache_dir.exists(head):
        out.append(f"{head} is missing: extract rewrites it from the target")
    elif head and (why := head_file_damage(cache_dir, head)) is not None:
        out.append(f"{cache_dir.display(head)} is damaged ({why}): extract rewrites it from the target")
    try:
        man = load_manifest(cache_dir)
    except CacheError as exc:
        out.append(f"{MANIFEST_FILE} is damaged ({exc.message}): extract rewrites it from the shard sidecars")
    else:
        if man["fingerprint"] != spec["fingerprint"]:
            out.append(f"{MANIFEST_FILE} names another fingerprint than {SPEC_FILE}: extract rewrites it from the "
                       "shard sidecars")
    return out


def make_plan(cfg: RunConfig) -> Plan:
    from .data.sources import dataset_fingerprint
    from .target.embedded import ensure_embedded_model_dir
    from .target.layers import check_servable, default_target_layer_ids, validate_layer_ids

    spec_str = cfg.target.model
    dev = check_device(cfg.extract.device, "--extract-device / [extract] device")
    device = torch.device("cuda" if dev == "auto" and torch.cuda.is_available() else ("cpu" if dev == "auto" else dev))
    dtype = resolve_target_dtype(cfg.target.dtype, device)
    cache_dir = open_cache_fs(cfg.extract.cache_dir)
    old = load_spec(cache_dir)
    if spec_str.startswith("random:"):
        plan = Plan(cfg, "run", "random-weight target: extract checks the fingerprint itself after building "
                                "the model (committed shards are skipped if it matches)", str(device),
                    target_line=f"{spec_str} (seed {cfg.target.seed}), {str(dtype)[6:]} on {device}")
        if old is not None and cache_dir.exists(MANIFEST_FILE):
            plan.reason += "; a complete cache exists here"
        plan.window = window_plan(cfg, cache_dir, old)
        return plan
    if spec_str.startswith("embedded:"):
        model_dir = ensure_embedded_model_dir(spec_str.split(":", 1)[1],
                                              Path(os.path.expanduser(cfg.target.model_cache_dir)))
    else:
        model_dir = Path(os.path.expanduser(spec_str)).resolve()
        if not model_dir.is_dir():
            raise UsageError(f"--target-model / [target] model '{spec_str}' is not a local directory",
                             "download it first (e.g. `hf download <repo> --local-dir DIR`) and pass DIR; "
                             "dflash-pipe never fetches from the hub")
    identity, text = _dir_identity(model_dir, cfg.target.trust_remote_code)
    identity["model_id"] = spec_str
    n_layers = int(text["num_hidden_layers"])
    layer_ids = validate_layer_ids(cfg.extract.layer_ids or default_target_layer_ids(cfg.extract.num_target_layers,
                                                                                     n_layers), n_layers)
    check_servable(layer_ids, n_layers, cfg.extract.allow_unservable_layers,
                   "pass --extract-allow-unservable-layers ([extract] allow_unservable_layers = true)")
    data_fp = dataset_fingerprint(cfg.data.source, cfg.data.format, cfg.data.skip_samples, cfg.data.max_samples)
    fields = fingerprint_fields(cfg, identity, layer_ids, data_fp, dtype)
    fp = fingerprint_of(fields)
    line = (f"{spec_str} ({text.get('model_type')}, {n_layers} layers, hidden {text.get('hidden_size')}), "
            f"{str(dtype)[6:]} on {device}")
    plan = Plan(cfg, "run", "no cache in this directory yet", str(device), fp, target_line=line, layer_ids=layer_ids)
    if old is None:
        plan.window = window_plan(cfg, cache_dir, None)
        return plan
    if old.get("fingerprint") != fp:
        plan.stage1, plan.differing = "refuse", diff_fields(old.get("fingerprint_fields", {}), fields)
        plan.reason = (f"the cache was extracted with different settings ({', '.join(plan.differing)}); "
                       "use a new cache dir or --overwrite")
        if cfg.extract.overwrite:   # extract deletes it and starts afresh, as the manifest asks
            plan.stage1 = "run"
            plan.reason = (f"the cache was extracted with different settings ({', '.join(plan.differing)}); "
                           "[extract] overwrite = true: extract deletes it and extracts afresh")
        return plan
    done = committed_shards(cache_dir, old)
    plan.committed = len(done)
    plan.window = window_plan(cfg, cache_dir, old)
    ledgers = load_ledgers(cache_dir, old)
    consumed = sorted(consumed_indices(cache_dir, old, ledgers))
    owners = ", ".join(led.owner for led in ledgers)
    if consumed and all(led.finished for led in ledgers):
        plan.stage1 = "run"
        plan.reason = (f"a finished window run ({owners}) consumed {len(consumed)} of {old['num_shards']} shards "
                       "(their files are deleted): extract re-extracts them")
    elif consumed:
        plan.stage1 = "resume"
        plan.reason = (f"a window run ({owners}) is streaming this cache: {len(consumed)} shards consumed, "
                       f"{plan.committed} of {old['num_shards']} committed")
    elif cache_dir.exists(MANIFEST_FILE) and plan.committed == old["num_shards"]:
        repairs = extract_repairs(cache_dir, old)
        if repairs:   # train would refuse the cache (exit 3, "rerun extract"): run extract, which mends it
            plan.stage1 = "resume"
            plan.reason = f"all {plan.committed} shards committed, but " + "; ".join(repairs)
        else:
            plan.stage1, plan.reason = "skip", "the cache is complete and its fingerprint matches this manifest"
    else:
        plan.stage1 = "resume"
        plan.reason = f"same fingerprint, {plan.committed} of {old['num_shards']} shards committed"
    return plan
