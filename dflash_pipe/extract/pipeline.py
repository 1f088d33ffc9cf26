"""Stage 1: run the target once over the data and write the feature cache.

Order of work (every rank):
  1. pick the device, load the target, resolve layer ids, compute the fingerprint;
  2. rank 0 creates or checks ``cache_spec.json`` (a different fingerprint is refused) and writes
     the frozen ``target_head.safetensors`` (embeddings + lm_head, all stage 2 needs of the target);
  3. each rank takes every world-th shard of the requested subset and skips committed ones;
  4. per shard: take its conversations (the source is read once per rank, shard_docs.py),
     tokenize, pack up to the token budget, forward, hand the features to the host pipeline
     (copy / compress / write overlapped); the shard's commit and sidecar run on the pipeline's
     writer thread while the next shard's forwards run (one pipeline per rank, see host_pipeline.py);
  5. once all of its commits finished, every rank tries to finalize ``manifest.json``
     (idempotent; done once all shards exist).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..cache import init_or_check_spec, make_spec, shard_name, try_finalize, write_sidecar
from ..cache.codec import FP8, fp8_error_terms
from ..cache.budget import DiskBudget
from ..cache.fs import CacheFS, open_cache_fs
from ..cache.manifest import HEAD_FILE, LAYER_CONVENTION, committed_shards, sidecar_name
from ..cache.schema import shard_meta
from ..cache.verify import head_file_damage
from ..cache.window import reset_consumed
from ..cache.writer import ShardWriter
from ..config import RunConfig, parse_shard_subset, write_resolved
from ..data.sources import dataset_fingerprint
from ..data.stats import DataStats
from ..data.tokenize import ConversationTokenizer
from ..faults import fault_point
from ..dist import DistInfo, barrier, init_process_group, pick_device, set_rank_cache_dirs
from ..progress import progress_bar
from .fingerprint import fingerprint_fields, resolve_target_dtype
from .host_pipeline import DocMeta, HostPipeline, ShardHandle
from .shard_docs import RankShardReader
from .staging import max_batch_bytes
from .sanity import feature_stats, layer_rms_summary

log = logging.getLogger("dflash_pipe.extract")


@dataclass
class ShardSummary:
    index: int
    docs: int
    tokens: int
    seconds: float
    gpu_blocked_s: float
    writer_idle_s: float
    compress_s: float
    commit_s: float = 0.0  # commit + sidecar, on the writer thread (overlaps the next shard)


@dataclass
class ExtractSummary:
    cache_dir: str
    status: str
    shards_done: list[int] = field(default_factory=list)
    shards_skipped: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    gpu_blocked_s: float = 0.0
    writer_wait_s: float = 0.0  # main thread waiting at the end for the last writes and commits
    space_wait_s: float = 0.0  # waiting for the window trainer to free disk space (--max-cache-gib)
    reextracted_consumed: list[int] = field(default_factory=list)  # shards a finished window run had deleted
    complete: bool = False
    kernel_paths: dict = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        if self.seconds <= 0:
            return "n/a"
        share = self.gpu_blocked_s / self.seconds
        tail = f"; {self.writer_wait_s:.1f}s waiting at the end for the last shard's writes and commit"
        return (f"host side (compression/disk): the target waited {share:.0%} of the time" if share > 0.05 else
                f"target forward (the host side kept up; the target waited {share:.1%} of the time)") + tail


def unused_embedding_row(tokenizer, vocab_size: int) -> tuple[int | None, str]:
    """An embedding row no real token of the data uses, for the drafter's MASK token.

    The first row past the tokenizer if the embedding is padded; otherwise the highest added
    special token that is not bos/eos/pad/unk and does not occur in the chat template (for
    SmolLM2: a code-data marker such as <empty_output> that chat data never contains).
    """
    if vocab_size > len(tokenizer):
        return len(tokenizer), "first embedding row past the tokenizer's vocabulary"
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template or ""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    cands = [i for i, tok in decoder.items() if i not in reserved and str(tok) not in template and i < vocab_size]
    if cands:
        i = max(cands)
        return i, f"added token {decoder[i]} (not bos/eos/pad, not in the chat template)"
    return None, "none found"


def target_summary(bundle, layer_ids: list[int]) -> dict:
    cfg = bundle.config
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
            "vocab_size", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings")
    text_cfg = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" not in text_cfg and isinstance(rope, dict) and "rope_theta" in rope:
        text_cfg["rope_theta"] = rope["rope_theta"]
    tok = bundle.tokenizer
    return {"model": bundle.identity.get("model_id"), "model_dir": str(bundle.model_dir) if bundle.model_dir else None,
            "family": bundle.family, "architecture": bundle.identity.get("architecture"),
            "num_layers": bundle.num_layers, "hidden_size": bundle.hidden_size, "vocab_size": bundle.vocab_size,
            "config": text_cfg, "identity": bundle.identity, "tokenizer_len": len(tok),
            "unused_embedding_row": unused_embedding_row(tok, bundle.vocab_size),
            "eos_token_id": tok.eos_token_id, "layer_ids": layer_ids}


def _owned_shards(cfg: RunConfig, info: DistInfo) -> list[int]:
    subset = parse_shard_subset(cfg.extract.shards, cfg.extract.num_shards)
    return [s for j, s in enumerate(subset) if j % info.world == info.rank]


def run_extract(cfg: RunConfig) -> ExtractSummary:
    from ..target.layers import check_extract_length, check_servable, default_target_layer_ids, validate_layer_ids
    from ..target.loading import load_target
    from ..target.runner import TargetRunner

    info = DistInfo.from_env()
    set_rank_cache_dirs(info, "extract")
    device = pick_device(cfg.extract.device, info, "--device / [extract] device")
    init_process_group(info, device)
    dtype = resolve_target_dtype(cfg.target.dtype, device)
    t = cfg.target
    bundle = load_target(t.model, device=device, dtype=dtype, revision=t.revision,
                         trust_remote_code=t.trust_remote_code, seed=t.seed, model_cache_dir=t.model_cache_dir,
                         attn_implementation=t.attn_implementation)
    ex = cfg.extract
    layer_ids = validate_layer_ids(ex.layer_ids or default_target_layer_ids(ex.num_target_layers, bundle.num_layers),
                                   bundle.num_layers)
    check_servable(layer_ids, bundle.num_layers, ex.allow_unservable_layers,
                   "pass --allow-unservable-layers ([extract] allow_unservable_layers = true)")
    check_extract_length(bundle.config, ex.max_length)
    data_fp = dataset_fingerprint(cfg.data.source, cfg.data.format, cfg.data.skip_samples, cfg.data.max_samples)
    fields = fingerprint_fields(cfg, bundle.identity, layer_ids, data_fp, dtype)
    width = len(layer_ids) * bundle.hidden_size
    features = {"layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION, "hidden_size": bundle.hidden_size,
                "num_layers": len(layer_ids), "width": width, "dtype": "bfloat16", "codec": ex.codec,
                "layout": "channel-major", "topk": ex.topk, "topk_dtype": "float16", "head_file": HEAD_FILE}
    spec = make_spec(fields, target_summary(bundle, layer_ids), features, ex.num_shards,
                     {"data": {"source": cfg.data.source, "format": cfg.data.format,
                               "skip_samples": cfg.data.skip_samples, "max_samples": cfg.data.max_samples},
                      "extract": {"max_length": ex.max_length, "token_budget": ex.token_budget,
                                  "allow_unservable_layers": ex.allow_unservable_layers}})
    cache_dir = open_cache_fs(ex.cache_dir)  # a directory or an object-store prefix (cache/fs.py)
    status, redo = "match", []
    if info.is_main:
        status = init_or_check_spec(cache_dir, spec, overwrite=ex.overwrite)
        cache_dir.remove_stale_temps()
        redo = reset_consumed(cache_dir, spec, lambda i: sidecar_name(i, ex.num_shards))
        if redo:
            log.info("a finished window run consumed shards %s of this cache: extracting them again", redo)
        if not cache_dir.exists(HEAD_FILE):
            _save_head(bundle, cache_dir)
        elif (why := head_file_damage(cache_dir, HEAD_FILE)) is not None:  # what `plan` said RESUME for
            log.warning("%s is damaged (%s): rewriting it from the target", cache_dir.display(HEAD_FILE), why)
            _save_head(bundle, cache_dir)
        write_resolved(cfg, ex.cache_dir)
    barrier()
    if not info.is_main:
        init_or_check_spec(cache_dir, spec, overwrite=False)
    summary = ExtractSummary(cache_dir.uri, status)
    summary.reextracted_consumed = redo if info.is_main else []
    held = max(1, cfg.train.passes_per_shard) + cfg.train.window_checkpoint_rounds - 1  # shards the trainer may hold
    budget = DiskBudget(cache_dir, ex.max_cache_gib, held, ex.space_wait_timeout_s)
    committed = committed_shards(cache_dir, spec)
    mine = _owned_shards(cfg, info)
    todo = [s for s in mine if s not in committed]
    summary.shards_skipped = [s for s in mine if s in committed]
    if todo:
        runner = TargetRunner(bundle, layer_ids, topk=ex.topk, linear_attn_kernels=t.linear_attn_kernels,
                              layout=ex.attention_layout)
        summary.kernel_paths = getattr(runner, "kernel_paths", {})
        shard_docs = RankShardReader(cfg.data, ex.num_shards, todo)  # one pass over the source, not one per shard
        bar = progress_bar(shard_docs.total_docs, f"extract rank {info.rank}", unit="doc", enabled=info.is_main)
        t0 = time.perf_counter()
        # one pipeline for all of this rank's shards: staging slots allocated once, shard commits
        # run on its writer thread while the next shard's forwards run here
        host = HostPipeline(_compress_workers(cfg), ex.queue_batches,
                            max_batch_bytes(ex.token_budget, width, len(layer_ids), ex.codec, ex.topk),
                            device, layer_ids, ex.codec, ex.sanity_check)
        try:
            for s in todo:
                _extract_shard(cfg, spec, runner, bundle.tokenizer, host, s, device, layer_ids, bar, info.rank,
                               budget, shard_docs)
            summary.writer_wait_s = host.close()  # every shard committed once this returns
        except BaseException:
            host.abort()
            raise
        finally:
            bar.close()
        for h in host.shards:
            shard: ShardSummary = h.result
            summary.shards_done.append(shard.index)
            summary.tokens += shard.tokens
            summary.gpu_blocked_s += shard.gpu_blocked_s
        summary.seconds = time.perf_counter() - t0
        summary.space_wait_s = budget.waited_s
    barrier()
    fault_point("extract.before_manifest")
    summary.complete = try_finalize(cache_dir, spec) is not None
    return summary


def _save_head(bundle, cache_dir: CacheFS) -> None:
    """target_head.safetensors: written in place locally; on a store saved to a local temp file, then
    uploaded as one object."""
    from ..target.loading import save_embeddings_and_head

    if cache_dir.is_local:
        save_embeddings_and_head(bundle, cache_dir.path(HEAD_FILE))
        return
    with tempfile.TemporaryDirectory(prefix="dflash-head-") as tmp:
        local = Path(tmp) / HEAD_FILE
        save_embeddings_and_head(bundle, local)
        cache_dir.upload_file(HEAD_FILE, local)


def _compress_workers(cfg: RunConfig) -> int:
    if cfg.extract.compress_workers > 0:
        return cfg.extract.compress_workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, per_rank // 2)


def _extract_shard(cfg: RunConfig, spec: dict, runner, tokenizer, host: HostPipeline, shard: int,
                   device: torch.device, layer_ids: list[int], bar, rank: int,
                   budget: DiskBudget | None = None, shard_docs: RankShardReader | None = None) -> ShardHandle:
    """Forward one shard's documents into `host` and queue its end (main thread).

    Returns as soon as the last batch is submitted: the commit and the sidecar run later on the
    writer thread (`finalize` below), while the caller already starts the next shard. The handle's
    `result` (a ShardSummary) is set once that commit finished.
    """
    ex, d = cfg.extract, cfg.data
    num_layers = len(layer_ids)
    if shard_docs is None:
        shard_docs = RankShardReader(d, ex.num_shards, [shard])
    mine = shard_docs.take(shard)  # this shard's (index, conversation) pairs, read once per rank
    reader_stats, tok_stats = mine.stats, DataStats()  # reader_stats: the whole reader's counts, as before
    ctok = ConversationTokenizer(tokenizer, ex.max_length)
    width = spec["features"]["width"]
    samples = [(idx, sample) for idx, conv in mine.docs if (sample := ctok(conv, tok_stats, d.strict)) is not None]
    tokens = sum(sample.num_tokens for _, sample in samples)  # known before the shard opens: the budget's estimate
    name = shard_name(shard, ex.num_shards)
    with budget.room_for_next_shard(tokens, name) if budget is not None else nullcontext():  # --max-cache-gib
        writer = ShardWriter(ex.cache_dir, name, shard, ex.codec, ex.topk,
                             shard_meta(ex.codec, ex.topk, width, num_layers, spec["fingerprint"]),
                             ex.row_group_mb << 20)
    handle = host.begin_shard(writer, shard)

    def run_pack(pack):
        lens = [s.num_tokens for _, s in pack]
        ids = torch.from_numpy(np.concatenate([s.input_ids for _, s in pack]).astype(np.int64))
        if device.type == "cuda":
            ids = ids.pin_memory()
        fault_point("extract.forward")
        out = runner.run(ids, lens)
        stats = feature_stats(out.hidden_TD, lens, num_layers)
        fp8 = fp8_error_terms(out.hidden_TD, lens, num_layers) if ex.codec == FP8 else None
        docs = [DocMeta(s.sample_id, idx, s.input_ids, s.loss_mask) for idx, s in pack]
        host.submit(docs, out.hidden_TD, lens, num_layers, out.topk_ids_TK, out.topk_logprobs_TK, stats, fp8)
        bar.update(len(pack), tokens=sum(lens))

    pack, pack_tokens = [], 0
    for idx, sample in samples:
        if pack and pack_tokens + sample.num_tokens > ex.token_budget:
            run_pack(pack)
            pack, pack_tokens = [], 0
        pack.append((idx, sample))
        pack_tokens += sample.num_tokens
    if pack:
        run_pack(pack)

    def finalize(h: ShardHandle) -> ShardSummary:
        """Writer thread, after the shard's last row: commit, then the sidecar (the main thread no
        longer touches this shard's reader/tokenizer stats)."""
        tc = time.perf_counter()
        info = writer.commit()
        timers = h.timers
        commit_s = time.perf_counter() - tc
        seconds = time.perf_counter() - h.started
        rms = {}
        if timers.stats_rows:
            lens = [n for n, _ in timers.stats_rows]
            rms = layer_rms_summary(torch.stack([s for _, s in timers.stats_rows]), lens, layer_ids)
        stats = {"data_reader": reader_stats.to_dict(), "data_tokenizer": tok_stats.to_dict(), "feature_rms": rms,
                 "timing": {"seconds": seconds, "gpu_blocked_s": timers.gpu_blocked_s,
                            "writer_idle_s": timers.writer_idle_s, "compress_s": timers.compress_s,
                            "commit_s": commit_s}}
        if timers.fp8_terms:
            acc = torch.stack(timers.fp8_terms)  # host copies, one per batch (came with the batch's D2H)
            stats["fp8_error"] = {"rel_l2_sum": float(acc[:, 0].sum()), "rel_l2_max": float(acc[:, 1].max()),
                                  "cos_min": float(acc[:, 2].min()), "tokens": int(acc[:, 3].sum())}
        fault_point("extract.before_sidecar")
        write_sidecar(ex.cache_dir, spec, info, stats)
        log.info("rank %d: shard %d committed: %d docs, %d tokens in %.1fs", rank, shard, info.rows, info.tokens,
                 seconds)
        return ShardSummary(shard, info.rows, info.tokens, seconds, timers.gpu_blocked_s, timers.writer_idle_s,
                            timers.compress_s, commit_s)

    host.end_shard(finalize)
    return handle
