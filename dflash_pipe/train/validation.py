"""Held-out validation: the drafter's loss, per-position accuracy and simulated tau on a second cache.

The simulated tau that training logs is measured on the batches it trains on; after several passes
over a small cache it mostly measures memorisation (the session-2 quality run: 5.3 on the training
stream, 1.8 in real speculative decoding). A validation cache, extracted from documents the training
cache does not hold (e.g. `dflash-pipe extract --skip-samples N` over the same source), gives the
number that predicts acceptance. Its batches have the training shapes, so the compiled layers are
reused (a no-grad pass compiles its own graphs once, with the recompile lock lifted just for it).
Rank r takes every world-th of the first `val_batches` batches; the sums are all-reduced with a
fixed layout, so a rank with no validation batch still joins and nothing can hang.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..cache import load_spec
from ..cache.codec import FP8, fp8_roundtrip, planes_to_hidden
from ..cache.fs import open_cache_fs
from ..cache.manifest import MANIFEST_FILE
from ..drafter import AttentionMask, block_positions, draft_loss, gather_kd_targets, summarize_metrics
from ..drafter.attention import compilation_unlocked, flex_tuning
from ..errors import CacheError, ValidationError
from .cache_index import CacheIndex, checked_manifest
from .loader import BatchLoader

log = logging.getLogger(__name__)


def draft_inputs(t: dict, batch, head, dcfg, codec: str, n_layers: int, feature_codec: str = "stored"):
    """Device tensors of one batch -> (features, block embeddings, ctx positions, block positions, mask).
    Pops the planes so their memory can go as soon as the bf16 features exist. feature_codec 'fp8' turns
    lossless features into an fp8 cache's values (train.feature_codec)."""
    hidden = planes_to_hidden(codec, t.pop("planes"), t.pop("scale", None), n_layers)
    if feature_codec == FP8:                  # (run_train refuses it on an fp8 cache)
        hidden = fp8_roundtrip(hidden, n_layers)
    mask = AttentionMask(t["ctx_doc_S"], t["anchor_index_N"], t["block_doc_N"], t["block_valid_N"], dcfg.block_size,
                         host=(batch.ctx_doc_S, batch.anchor_index_N, batch.block_doc_N, batch.block_valid_N))
    if dcfg.attention == "flex":
        mask.block_mask(flex_block=flex_tuning()["block"])  # built outside the compiled layers, cached
    bpos = block_positions(t["ctx_pos_S"], t["anchor_index_N"], dcfg.block_size)
    embeds = head.block_embeds(batch.anchor_tokens_N, dcfg.mask_token_id, dcfg.block_size, torch.float32)
    return hidden, embeds, t["ctx_pos_S"], bpos, mask


def kd_targets(t: dict, dcfg, kd_weight: float):
    if kd_weight > 0 and "topk_ids_SK" in t:
        return gather_kd_targets(t["topk_ids_SK"], t["topk_logprobs_SK"], t["anchor_index_N"], dcfg.block_size,
                                 kd_weight)
    return None


def _check_compatible(val_spec: dict, train_spec: dict, dcfg, val_dir: str) -> None:
    """The drafter fits the validation cache (as any cache it trains on) and both caches come from the
    same target and tokenizer; documents and codec may differ."""
    from .components import cache_identity, check_against_cache

    check_against_cache(dcfg, val_spec, f"--val-cache-dir {val_dir}: the drafter")
    a, b = cache_identity(val_spec), cache_identity(train_spec)
    diff = {k: (a[k], b[k]) for k in b if a.get(k) != b[k]}
    if diff:
        lines = "; ".join(f"{k}: validation {x!r} vs training {y!r}" for k, (x, y) in diff.items())
        raise ValidationError(f"--val-cache-dir {val_dir} does not fit the training cache: {lines}",
                              "extract the validation cache with the same target, layers and tokenizer")


_SCALARS = ("loss_sum", "ce_sum", "kd_sum", "weight_sum", "tau_sum", "inv_tau_sum", "num_blocks")
_PER_SLOT = ("correct_per_slot", "valid_per_slot")


class Validator:
    """Opens the validation cache at once, or, with --follow and a validation cache still being extracted (no
    manifest yet: both extractions started beside the trainer), at the first validation pass, waiting for it
    there up to --follow-timeout-s. Its spec is checked against the drafter as soon as it exists."""

    def __init__(self, cfg, train_spec: dict, dcfg, head, device: torch.device, rank: int, world: int,
                 autocast, gamma: float):
        self.cfg, self.dcfg, self.head, self.device = cfg, dcfg, head, device
        self.autocast, self.gamma = autocast, gamma
        self.rank, self.world = rank, world
        self.train_spec, self.index, self.loader = train_spec, None, None
        tr = cfg.train
        fs = open_cache_fs(tr.val_cache_dir)
        self._damage_said = False
        if tr.follow and not self._complete(fs):
            spec = load_spec(fs)
            if spec is not None:
                _check_compatible(spec, train_spec, dcfg, tr.val_cache_dir)
            log.info("validation cache %s is not complete yet: opening it at the first validation pass",
                     tr.val_cache_dir)
            return
        self._open()

    def _complete(self, fs) -> bool:
        """Whether the validation cache's manifest is there and checks out (cache_index.checked_manifest). Under
        --follow only: a damaged one counts as not written yet (one warning), as for the training cache."""
        if not fs.exists(MANIFEST_FILE) or (spec := load_spec(fs)) is None:
            return False
        try:
            checked_manifest(fs, spec)
        except CacheError as exc:
            if not self._damage_said:
                log.warning("follow: validation cache %s is damaged (%s); waiting for extract to rewrite it "
                            "(rerun its `dflash-pipe extract` if none is running)", fs.display(MANIFEST_FILE),
                            exc.message)
                self._damage_said = True
            return False
        return True

    def _wait_for_manifest(self) -> None:
        tr = self.cfg.train
        fs, t0 = open_cache_fs(tr.val_cache_dir), time.monotonic()
        while not self._complete(fs):
            if time.monotonic() - t0 > tr.follow_timeout_s:
                raise CacheError(f"--val-cache-dir {tr.val_cache_dir}: no {MANIFEST_FILE} after waiting "
                                 f"{tr.follow_timeout_s:.0f} s at the first validation pass (extraction of the "
                                 "validation cache has not finished)",
                                 "finish (or rerun to resume) its `dflash-pipe extract`, then resume training "
                                 "with --resume auto")
            time.sleep(tr.follow_poll_s)

    def _open(self) -> None:
        cfg, dcfg, device = self.cfg, self.dcfg, self.device
        tr = cfg.train
        self.index = CacheIndex(tr.val_cache_dir)
        _check_compatible(self.index.spec, self.train_spec, dcfg, tr.val_cache_dir)
        # one schedule for all ranks (world 1): the first `val_batches` batches are the validation set,
        # and rank r takes every world-th of them, so no document is dropped to even out the ranks
        self.loader = BatchLoader(self.index, rank=0, world=1, seed=tr.seed, context_tokens=tr.context_tokens,
                                  num_anchors=tr.num_anchors, max_anchors_per_doc=tr.max_anchors_per_doc,
                                  block_size=dcfg.block_size, shuffle_rows=1, workers=max(1, tr.loader_workers // 2),
                                  want_topk=tr.kd_weight > 0, pin_memory=device.type == "cuda",
                                  read_ahead=tr.loader_read_ahead)
        feats = self.index.spec["features"]
        self.codec, self.n_layers = feats["codec"], feats["num_layers"]

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> dict[str, float]:
        """One pass over the first `val_batches` validation batches (the same ones every time)."""
        tr = self.cfg.train
        if self.loader is None:
            self._wait_for_manifest()
            self._open()
        sums: dict[str, torch.Tensor] = {}
        was_training = model.training
        model.eval()
        try:
            with compilation_unlocked():
                sched = self.loader.schedule(0, follow_first_epoch=False)
                for g in range(self.rank, min(tr.val_batches, sched.steps), self.world):
                    batch = self.loader.assemble(sched.batch(0, g), 0, g)
                    t = {k: v.to(self.device) for k, v in batch.tensors().items()}  # blocking: rare, and
                    # the host buffers can go back to the pool once the step below has run
                    kd = kd_targets(t, self.dcfg, tr.kd_weight)
                    args = draft_inputs(t, batch, self.head, self.dcfg, self.codec, self.n_layers)
                    with self.autocast:
                        out = model(*args)
                        _, metrics = draft_loss(out, self.head.lm_head_VH, t["labels_NB"], self.dcfg.block_size,
                                                self.gamma, tr.loss_chunk_tokens, kd, fused=tr.fused_loss)
                    for k, v in metrics.items():
                        v = torch.atleast_1d(v.detach().to(torch.float64))
                        sums[k] = sums[k] + v if k in sums else v
                    batch.release()
        finally:
            model.train(was_training)
        if dist.is_initialized():  # fixed layout, so a rank with no validation batch still joins
            B = self.dcfg.block_size
            layout = [(k, 1) for k in _SCALARS] + [(k, B) for k in _PER_SLOT]
            packed = torch.cat([sums.get(k, torch.zeros(m, dtype=torch.float64, device=self.device)).reshape(m)
                                for k, m in layout])
            dist.all_reduce(packed)
            sums, i = {}, 0
            for k, m in layout:
                sums[k] = packed[i:i + m]
                i += m
        if not sums or float(sums["num_blocks"].sum()) == 0:
            return {}
        out = summarize_metrics({k: (v.cpu() if k in _PER_SLOT else v.reshape(()).cpu()) for k, v in sums.items()})
        return {f"val_{k}": v for k, v in out.items()}

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
