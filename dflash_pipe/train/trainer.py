"""Stage 2: train a DFlash drafter from the feature cache (one process, or DDP under torchrun).

Fixed build order: process group + device -> cache index -> drafter config (checked against the
cache) -> frozen head -> drafter -> optimizer/schedule -> resume -> loader -> loop -> export.
SIGINT / SIGTERM stop the loop at a step boundary with a checkpoint and exit 130 (graceful.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ..cache.codec import FP8
from ..config import RunConfig, write_resolved
from ..dist import (DistInfo, agree_on_plan, all_ranks_say, barrier, destroy, init_process_group, pick_device,
                    set_rank_cache_dirs)
from ..drafter.attention import compilation_locked
from ..drafter import default_gamma, draft_loss, export_drafter, lock_compilation, unlock_compilation
from ..errors import UsageError, ValidationError
from ..faults import fault_point, trace_batch
from .checkpoint import find_resume, load_checkpoint, read_state, save_checkpoint
from .checkpoint_writer import BackgroundCheckpoints
from .components import (FrozenHead, build_drafter_config, build_model, build_optimizer, cache_identity,
                         check_against_cache, check_resume_identity, init_state_from_export, resolve_param_dtype)
from .graceful import GracefulStop
from .master_weights import MasterWeights
from .validation import Validator, draft_inputs, kd_targets
from .cache_index import CacheIndex, shard_subset
from .loader import BatchLoader, FollowTimeout
from .metrics import StepLogger, plot_history, step_flops
from .round_carry import RoundCarry
from .device_feed import DeviceFeed
from .round_clock import RoundClock
from . import thread_times
from .step_profile import StepProfiler
from .step_stats import PendingStepStats, StepStats
from .window_lr import WindowLR, planned_total
from .window_run import WindowCoordinator, window_group

log = logging.getLogger("dflash_pipe.train")


def _precision(cfg: RunConfig, device: torch.device) -> str:
    p = cfg.train.precision
    return ("bf16" if device.type == "cuda" else "fp32") if p == "auto" else p


def _steps_per_epoch(loader: BatchLoader, epochs: int, follow: bool) -> list[int]:
    out = []
    for e in range(epochs):
        sched = loader.schedule(e, follow_first_epoch=follow and e == 0)
        if not sched.final:  # follow mode: estimate from the shards seen so far
            seen = max(1, len(loader.index.lengths))
            out.append(max(1, int(sched.steps * loader.index.spec["num_shards"] / seen)))
        else:
            out.append(sched.steps)
    return out


def _window(cfg: RunConfig, index: CacheIndex, out_dir: Path, info: DistInfo, device, loader: BatchLoader):
    """The window coordinator of `--follow --passes-per-shard K`, or None (whole-cache epochs)."""
    tr = cfg.train
    if tr.passes_per_shard <= 0:
        return None
    if not tr.follow:
        raise UsageError("--passes-per-shard (window mode) needs --follow", "add --follow, or set it to 0")
    if tr.shards.strip():
        raise UsageError("--passes-per-shard (window mode) cannot be combined with --shards")
    coord = WindowCoordinator(index, out_dir, tr.passes_per_shard, info.rank, info.world, device, tr.follow_poll_s,
                              tr.follow_timeout_s, tr.seed, tr.context_tokens, tr.shuffle_rows,
                              group=window_group(tr.window_group, out_dir))
    loader.schedule_fn = coord.schedule
    if tr.window_read_ahead:
        loader.carry = RoundCarry(coord.peek_schedule, tr.follow_poll_s)
    return coord


def run_train(cfg: RunConfig) -> dict:
    tr = cfg.train
    info = DistInfo.from_env()
    set_rank_cache_dirs(info, "train")
    device = pick_device(tr.device, info, "--device / [train] device")
    distributed = init_process_group(info, device)
    out_dir = Path(tr.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        write_resolved(cfg, out_dir)

    index = CacheIndex(cfg.train_cache_dir, follow=tr.follow, shards=tr.shards,
                       wait_s=tr.follow_timeout_s if tr.follow else 0.0)
    spec = index.spec
    dcfg = build_drafter_config(cfg, spec, device)
    check_against_cache(dcfg, spec, "drafter config")
    precision = _precision(cfg, device)
    head = FrozenHead(cfg.train_cache_dir, spec["features"]["head_file"], device,
                      torch.bfloat16 if precision == "bf16" else torch.float32,
                      scratch=out_dir / ".cache_head")  # object storage only
    # auto: compiled on CUDA, except the grouped SDPA path, whose shapes change every step (config refuses "on")
    compile_layers = tr.compile == "on" or (tr.compile == "auto" and device.type == "cuda"
                                            and dcfg.attention != "sdpa-grouped")
    resume = find_resume(out_dir, tr.resume)
    saved = read_state(resume) if resume is not None else None  # the checkpoint's state.json, read once
    init = init_state_from_export(tr.init_from, dcfg) if tr.init_from and resume is None else None
    model = build_model(dcfg, device, tr.seed, compile_layers, tr.checkpoint_mlp_layers, init)
    weights = MasterWeights(model, resolve_param_dtype(cfg, precision))  # before DDP and the optimizer
    loader = BatchLoader(index, rank=info.rank, world=info.world, seed=tr.seed, context_tokens=tr.context_tokens,
                         num_anchors=tr.num_anchors, max_anchors_per_doc=tr.max_anchors_per_doc,
                         block_size=dcfg.block_size, shuffle_rows=tr.shuffle_rows, workers=tr.loader_workers,
                         want_topk=tr.kd_weight > 0, pin_memory=device.type == "cuda",
                         follow_poll_s=tr.follow_poll_s, prefetch=tr.loader_prefetch, read_ahead=tr.loader_read_ahead,
                         copy_anchor_weight=tr.copy_anchor_weight,
                         follow_timeout_s=tr.follow_timeout_s if tr.follow else 0.0)
    coord = _window(cfg, index, out_dir, info, device, loader)
    window_lr = None
    if coord is not None:  # window mode: rounds instead of epochs; the LR curve runs over shard passes
        if saved is not None:
            epoch_steps, est = saved["epoch_steps"], saved["total_steps"]
        else:
            coord.wait_round(0)
            epoch_steps = [coord.schedule(0).steps]
            est = planned_total(0, epoch_steps[0], 0, coord.passes, coord.n)
        total = est if not tr.max_steps else tr.max_steps  # --max-steps: the step curve over exactly that many
        if not tr.max_steps:
            window_lr = WindowLR(coord.passes, coord.n, tr.warmup_frac, tr.min_lr_frac)
    elif saved is not None and tr.follow:  # the checkpoint's plan, before the LR curve is built over it: a fresh
        epoch_steps, total = saved["epoch_steps"], saved["total_steps"]  # count would see later shards
    else:
        if tr.follow:
            loader.wait_for_step(0, 0, follow_first_epoch=True)
        epoch_steps = agree_on_plan(_steps_per_epoch(loader, tr.epochs, tr.follow), device)
        total = sum(epoch_steps) if not tr.max_steps else min(tr.max_steps, sum(epoch_steps))
        if saved is not None and saved["total_steps"] != total:  # the LR curve is the checkpoint's
            raise UsageError(f"checkpoint {resume} belongs to a run of {saved['total_steps']} steps; "
                             f"these flags (--epochs, --max-steps) plan {total}",
                             "resume with the original flags, or start a new run from its weights "
                             "(--init-from <its export> --output-dir <new>)")
    if total <= 0:
        raise ValidationError(f"cache {cfg.train_cache_dir} yields no training batch at --context-tokens "
                              f"{tr.context_tokens} (world size {info.world})", "add data or lower the world size")
    opt, sched = build_optimizer(weights.masters, cfg, device, total, lr_factor=window_lr)
    step, epoch, step_in_epoch = 0, 0, 0
    if resume is not None:
        check_resume_identity(saved, spec, resume, dcfg, index.subset)  # before touching any weights
        if saved.get("passes_per_shard", 0) != tr.passes_per_shard:
            raise ValidationError(f"checkpoint {resume} was trained with --passes-per-shard "
                                  f"{saved.get('passes_per_shard', 0)}, this run asks for "
                                  f"{tr.passes_per_shard}", "resume with the original value, or a new --output-dir")
        state = load_checkpoint(resume, weights, opt, device)
        step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        epoch_steps, total = state["epoch_steps"], state["total_steps"]
        # the optimizer's param groups already carry the lr of `step` (saved after its scheduler step)
        sched.last_epoch = step
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        if info.is_main:
            print(f"resumed from {resume} at step {step} (epoch {epoch}, batch {step_in_epoch})", flush=True)
        if coord is not None:
            coord.collect(epoch)  # a kill after the boundary checkpoint, before its deletions
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True) if distributed else model
    gamma = tr.gamma or default_gamma(dcfg.block_size)
    trainable = sum(p.numel() for p in model.parameters())
    flops = step_flops(trainable, head.lm_head_VH.numel(), tr.num_anchors * dcfg.block_size)
    logger = StepLogger(out_dir, total, info.is_main, device, flops)
    logger.truncate_history(step - 1)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext())
    codec, n_layers = spec["features"]["codec"], spec["features"]["num_layers"]
    if tr.feature_codec == FP8 and codec == FP8:
        raise UsageError(f"--feature-codec fp8: the cache {tr.cache_dir} already holds fp8 features",
                         "drop --feature-codec (it quantises a lossless cache as the fp8 codec would)")
    validator = (Validator(cfg, spec, dcfg, head, device, info.rank, info.world, autocast, gamma)
                 if tr.val_cache_dir else None)
    if info.is_main:
        print(f"train: drafter {dcfg.num_layers} layers, {trainable / 1e6:.1f}M trainable params, attention "
              f"{dcfg.attention}, {precision}, compile={compile_layers}, world {info.world}, {total} steps "
              f"({epoch_steps} per epoch), mask token {dcfg.mask_token_id}"
              + (f", {codec} features quantised to fp8 on the device" if tr.feature_codec == FP8 else "")
              + (f", weights from {tr.init_from}" if init else ", --init-from ignored (resumed)" if tr.init_from else ""),
              flush=True)
    last = {}
    # each step's metrics and grad norm reach the host one step later (step_stats.py); drained before
    # anything that needs every finished step: validation, a checkpoint, a stop, the end of an epoch/round
    stats = PendingStepStats(device)

    def report(record) -> None:
        if record is not None:
            last.update(metrics=record.metrics, grad_norm=record.grad_norm)
            note = dict(record.note)
            if note.pop("log"):  # a logging step
                logger.log(metrics=record.metrics, step_s=record.seconds, grad_norm=record.grad_norm, **note)
                last.pop("unlogged", None)
            else:  # logged after all if the run ends on it (data ran out before the planned last step)
                last["unlogged"] = (record, note)

    def log_last_step() -> None:
        report(stats.drain())
        if "unlogged" in last:
            record, note = last.pop("unlogged")
            logger.log(metrics=record.metrics, step_s=record.seconds, grad_norm=record.grad_norm, **note)
    # window mode: round-boundary checkpoints written off the step loop; the shards a boundary retired are
    # deleted (coord.collect) on the same background thread once its checkpoint is COMPLETE
    ckw = BackgroundCheckpoints(out_dir, tr.keep_checkpoints, after_write=coord.collect) if (
        coord is not None and info.is_main and tr.window_async_checkpoint) else None

    # window mode: what each round boundary spends its time on (round_clock.py; window_rounds.jsonl, rank 0)
    clock = RoundClock(out_dir / "window_rounds.jsonl" if coord is not None and info.is_main else None)
    profiler = StepProfiler(tr.profile_steps, out_dir, info.is_main, device)   # --profile-steps (rank 0)

    def settle(block: bool) -> None:
        """A finished background write (and its deletions): its errors raised here, its deletion time noted."""
        if ckw is not None and (ckw.wait() if block else ckw.done()) is not None:
            clock.add("collect", ckw.last_after_write_s)

    def sync_checkpoint(at_step, at_epoch, at_step_in_epoch):
        report(stats.drain())  # a non-finite gradient norm raises here, before its weights are saved
        settle(True)  # one writer at a time: the background write (and its deletions) completes first
        _checkpoint(out_dir, at_step, at_epoch, at_step_in_epoch, weights, opt, epoch_steps, total, spec, dcfg, cfg,
                    info)

    with GracefulStop(device, info, tr.log_every) as stop:  # SIGINT/SIGTERM: checkpoint, exit 130
        try:
            cap = tr.max_steps or None  # otherwise every epoch runs until its data ends (follow: when extraction does)
            phases = coord.rounds if coord is not None else tr.epochs  # window mode: one phase per round
            profiler.before_next_step(step)   # a window from this step (0, or where a resumed run starts)
            threads0, step0, t_loop = (thread_times.snapshot() if info.is_main else {}), step, time.perf_counter()
            while epoch < phases and (cap is None or step < cap):
                follow_first = tr.follow and epoch == 0
                stats.begin_phase()
                t_round = time.perf_counter()
                shard_wait = 0.0
                if coord is not None:  # collective: every rank agrees on the window
                    with clock.part("shard_wait"):
                        shard_wait = coord.wait_round(epoch, before_waiting=lambda: settle(True))
                    if window_lr is not None:  # the round's step count is known now: the curve and total follow
                        round_steps = coord.schedule(epoch).steps
                        window_lr.begin_round(epoch, step - step_in_epoch, round_steps)
                        window_lr.refresh(opt, sched)
                        total = logger.total = planned_total(step - step_in_epoch, round_steps, epoch,
                                                             coord.passes, coord.n)
                round_wait = time.perf_counter() - t_round
                batches = DeviceFeed(loader.iterate(epoch, step_in_epoch, follow_first_epoch=follow_first), device)
                phase_done = False
                while cap is None or step < cap:
                    t_wait = time.perf_counter()
                    with clock.part("first_batch"):  # timed at a round's first step only (clock.end)
                        item = next(batches, None)
                    clock.end(epoch, step)
                    data_wait = time.perf_counter() - t_wait + round_wait
                    round_wait = 0.0
                    if item is None:
                        phase_done = True
                        break
                    batch, on_device = item
                    lr_now = opt.param_groups[0]["lr"]  # the step's own lr (the scheduler moves on inside it)
                    step_stats = _train_step(ddp, weights, head, opt, sched, batch, dcfg, device, autocast, codec,
                                             n_layers, gamma, cfg, on_device, after_backward=batches.prefetch)
                    data_wait += batches.take_wait_s()
                    trace_batch(step, epoch, info.rank, batch.sample_ids)
                    if not compilation_locked() and (device.type == "cuda" or compile_layers):
                        lock_compilation()  # after this process's first step everything is compiled: a
                        # recompile is an error from here on, not a silent dense fallback (on the CPU only
                        # compiled layers are at stake; the same lock lets the CPU tests run this flow)
                    step += 1
                    step_in_epoch += 1
                    note = dict(log=step % tr.log_every == 0 or step == total, step=step - 1, epoch=epoch,
                                data_wait_s=data_wait, tokens=batch.tokens,
                                anchors=int(batch.block_valid_N.sum()),  # a host tensor: no device sync
                                lr=lr_now, shard_wait_s=shard_wait if coord is not None else None,
                                peak_mem_gib=logger.peak_mem_gib())
                    report(stats.push(step_stats, note))  # reads the step before this one
                    profiler.after_step(step)
                    shard_wait = 0.0
                    settle(False)
                    if validator is not None and step % tr.val_every == 0 and step != total:
                        report(stats.drain())
                        logger.log_validation(step - 1, validator.run(model))
                        profiler.note(f"validation after step {step}")
                    stopping = stop.should_stop(step)  # every rank, every step (a collective when world > 1)
                    if stopping or (tr.checkpoint_every and step % tr.checkpoint_every == 0 and step != total):
                        sync_checkpoint(step, epoch, step_in_epoch)
                        profiler.note(f"checkpoint after step {step}")
                    profiler.before_next_step(step)
                    fault_point("train.after_step")
                    if stopping:
                        stop.leave(step, total, out_dir)  # raises StopRequested: exit 130, no export
                if coord is not None and not phase_done and step_in_epoch >= coord.schedule(epoch).steps:
                    phase_done = True  # --max-steps fell on the round's last step: the round is over all the same
                if coord is not None and epoch + 1 < phases:
                    clock.begin()
                    profiler.note(f"round boundary after step {step}")
                with clock.part("drain"):
                    report(stats.drain())  # the phase's last step: before its boundary and the next phase's clock
                if not phase_done:
                    break  # --max-steps inside an epoch or round: the position stays inside it
                epoch += 1
                step_in_epoch = 0
                if coord is not None:  # round boundary: retire, checkpoint, then delete what it no longer needs
                    with clock.part("end_round"):
                        coord.end_round(epoch - 1, loader)
                    if epoch < phases and epoch % tr.window_checkpoint_rounds == 0:
                        if tr.window_async_checkpoint:  # the same branch on every rank; only rank 0 writes
                            with clock.part("checkpoint_wait"):
                                settle(True)  # the previous boundary's write and its deletions first
                            if ckw is not None:
                                with clock.part("snapshot"):
                                    _checkpoint(out_dir, step, epoch, 0, weights, opt, epoch_steps, total, spec,
                                                dcfg, cfg, info, writer=ckw)
                        else:
                            with clock.part("snapshot"):  # the whole checkpoint, written on the step loop
                                _checkpoint(out_dir, step, epoch, 0, weights, opt, epoch_steps, total, spec, dcfg,
                                            cfg, info)
                            coord.collect(epoch)
            log_last_step()
            if (line := thread_times.report_run(out_dir, threads0, step - step0, time.perf_counter() - t_loop,
                                                    stats.device_wait_s)):
                print(line, flush=True)   # is the step loop's thread busy all along? (thread_times.py)
            sync_checkpoint(step, epoch, step_in_epoch)
            if coord is not None and epoch >= coord.rounds:
                coord.finish()  # every shard read K times: delete the rest, mark the cache consumed
            if validator is not None:
                last["val"] = logger.log_validation(step - 1, validator.run(model))
            if info.is_main:
                export_drafter(model, dcfg, out_dir / "export")
                plot_history(out_dir / "metrics.jsonl", out_dir / "training.png")
                print(f"train: done, {step} steps; drafter exported to {out_dir / 'export'}", flush=True)
                if (boundaries := clock.summary()) is not None:
                    print(boundaries, flush=True)
        except FollowTimeout:
            # the extractor seems gone: keep the steps trained since the last checkpoint (`--resume auto` goes on
            # from here once extraction resumes). With world > 1 only if every rank timed out at this same step
            # (agreed through the rendezvous store, not a collective): a rank that got its batch sits in the next
            # step's gradient all-reduce, and the checkpoint's barrier would meet that instead
            at = f"{step}:{epoch}:{step_in_epoch}"
            if all_ranks_say("follow-timeout", at, wait_s=30 + 5 * tr.follow_poll_s, poll_s=tr.follow_poll_s):
                sync_checkpoint(step, epoch, step_in_epoch)
                if info.is_main:
                    print(f"train: follow timed out; checkpointed step {step} (epoch {epoch}, batch "
                          f"{step_in_epoch})", flush=True)
            else:
                log.warning("follow timed out, but not every rank at step %d: the steps since the last checkpoint "
                            "are not kept", step)
            raise
        except BaseException:
            try:  # the step that finished before the failure still gets its log line
                report(stats.drain())
            except Exception:  # noqa: BLE001 - the error already propagating is the one to report
                pass
            raise
        finally:
            profiler.close()
            if ckw is not None:  # an error elsewhere: let a background write complete (resume collects it)
                try:
                    ckw.wait()
                except Exception as exc:  # noqa: BLE001 - the error already propagating is the one to report
                    log.warning("window: the background checkpoint failed too (%s)", exc)
            unlock_compilation()
            loader.close()
            if validator is not None:
                validator.close()
            logger.close()
            destroy()
    return {"steps": step, "metrics": last.get("metrics", {}), "val": last.get("val", {}), "output_dir": str(out_dir)}


def _state(step, epoch, step_in_epoch, epoch_steps, total, spec, dcfg, cfg) -> dict:
    return {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "epoch_steps": epoch_steps,
            "total_steps": total, "drafter_config": dcfg.to_dict(), "cache_identity": cache_identity(spec),
            "train_shards": shard_subset(spec, cfg.train.shards),
            "cache_fingerprint": spec["fingerprint"], "seed": cfg.train.seed,
            "passes_per_shard": cfg.train.passes_per_shard}


def _checkpoint(out_dir, step, epoch, step_in_epoch, weights, opt, epoch_steps, total, spec, dcfg, cfg, info,
                writer: BackgroundCheckpoints | None = None):
    """A complete checkpoint (rank 0 writes, every rank waits at the barrier). With `writer` (window round
    boundaries, rank 0 only): snapshot now, write in the background, no barrier; returns the boundary of the
    previous background write if it had to be waited for."""
    state = _state(step, epoch, step_in_epoch, epoch_steps, total, spec, dcfg, cfg)
    if writer is not None:
        return writer.submit(step, epoch, weights, opt, state)
    if info.is_main:
        save_checkpoint(out_dir, step, weights, opt, state, keep=cfg.train.keep_checkpoints)
    barrier()
    return None


def _train_step(ddp, weights: MasterWeights, head, opt, sched, batch, dcfg, device, autocast, codec, n_layers,
                gamma, cfg, on_device: dict | None = None, after_backward=None) -> StepStats:
    """One optimizer step. `after_backward()` (DeviceFeed.prefetch) runs between backward and the update.
    Returns the step's metrics and gradient norm still on the device (no host sync; step_stats.py)."""
    tr = cfg.train
    t = on_device if on_device is not None else {k: v.to(device, non_blocking=True)
                                                 for k, v in batch.tensors().items()}
    kd = kd_targets(t, dcfg, tr.kd_weight)
    inputs = draft_inputs(t, batch, head, dcfg, codec, n_layers, tr.feature_codec)  # planes -> bf16, mask, embeds
    with autocast:
        out = ddp(*inputs)
        loss, metrics = draft_loss(out, head.lm_head_VH, t["labels_NB"], dcfg.block_size, gamma,
                                   tr.loss_chunk_tokens, kd, fused=tr.fused_loss)
    loss.backward()
    if after_backward is not None:
        after_backward()
    grad_norm = weights.step(opt, tr.grad_clip)  # clip, AdamW on the fp32 masters, refresh bf16 weights
    sched.step()
    opt.zero_grad(set_to_none=True)  # weights.step already dropped the bf16 compute grads
    # world > 1: the metric sums are all-reduced on the device, queued behind the step like the rest
    return StepStats.pack(metrics, grad_norm, batch.epoch, batch.step,
                          all_reduce=dist.all_reduce if dist.is_initialized() else None)
