"""Step metrics: one log line per step, TensorBoard scalars, a JSONL history and end-of-run PNGs.

FLOPs are counted as 6 x trainable parameters x query tokens + 4 x lm_head parameters x query
tokens (forward + input-gradient through the frozen head), which is how the seed's baseline was
counted. MFU divides by the GPU's measured dense bf16 rate (790 TFLOP/s on an H200 here; set
DFLASH_PEAK_TFLOPS for other cards). The ETA skips the first steps (compilation, warm-up), then runs on the
wall time between logged steps (every record has its unix `time`), so validation and checkpoints count.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from ..io_utils import append_durably, atomic_write_text, write_optional

log = logging.getLogger("dflash_pipe.train")

WARMUP_STEPS_FOR_ETA = 3


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("DFLASH_PEAK_TFLOPS"):
        return float(os.environ["DFLASH_PEAK_TFLOPS"]) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H200" in name or "H100" in name:
            return 790e12
    return None


def step_flops(trainable_params: int, lm_head_params: int, query_tokens: int) -> float:
    return 6.0 * trainable_params * query_tokens + 4.0 * lm_head_params * query_tokens


class StepLogger:
    def __init__(self, out_dir: Path, total_steps: int, enabled: bool, device: torch.device, flops_per_step: float,
                 tensorboard: bool = True):
        self.out_dir = out_dir
        self.total = total_steps
        self.enabled = enabled
        self.device = device
        self.flops = flops_per_step
        self.peak = peak_flops(device)
        self.history_path = out_dir / "metrics.jsonl"
        self._times: list[float] = []
        self._clock: tuple[float, int] | None = None  # (wall time, step) of the first logged step after warm-up
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the run goes on without it
                log.warning("TensorBoard not started in %s (%s); continuing without TensorBoard",
                            out_dir / "tensorboard", exc)
                self.tb = None

    def truncate_history(self, after_step: int) -> None:
        """On resume: drop history lines of steps that will be redone."""
        if not self.enabled or not self.history_path.exists():
            return
        for path in (self.history_path, self.out_dir / "val_metrics.jsonl"):
            if path.exists():
                keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= after_step]
                atomic_write_text(path, "".join(k + "\n" for k in keep))

    def peak_mem_gib(self) -> float | None:
        """The allocator's peak so far (CUDA; a host-side count, no sync), None on the CPU."""
        return torch.cuda.max_memory_allocated(self.device) / 2 ** 30 if self.device.type == "cuda" else None

    def log(self, step: int, epoch: int, metrics: dict, step_s: float, data_wait_s: float, tokens: int,
            lr: float, grad_norm: float, shard_wait_s: float | None = None, peak_mem_gib: float | None = None,
            anchors: int | None = None) -> dict:
        """One step's record; `peak_mem_gib` as read at that step (default: now); `anchors`: the step's real
        (non-padding) blocks on this rank, of --num-anchors (the rest carry no loss)."""
        now = time.time()
        self._times.append(step_s)
        # the ETA runs on wall time between logged steps once past the warm-up, so that validation, checkpoints
        # and a window's round boundaries count too (the step's own time alone left session 18's ETA ~20 % short)
        if self._clock is None and len(self._times) > WARMUP_STEPS_FOR_ETA:
            self._clock = (now, step)
        if self._clock is not None and step > self._clock[1]:
            mean = (now - self._clock[0]) / (step - self._clock[1])
        else:  # until then: the mean step time, past the warm-up steps where there are any
            steady = self._times[WARMUP_STEPS_FOR_ETA:] or self._times
            mean = sum(steady) / len(steady)
        eta = (self.total - step - 1) * mean
        rec = {"step": step, "epoch": epoch, "time": round(now, 3), **metrics, "lr": lr, "grad_norm": grad_norm,
               "step_s": step_s,
               "data_wait": data_wait_s / max(step_s, 1e-9), "tok_s": tokens / max(step_s, 1e-9),
               "tflops": self.flops / max(step_s, 1e-9) / 1e12}
        if anchors is not None:
            rec["anchors"] = anchors
        if shard_wait_s is not None:  # window mode: the part of data_wait spent waiting for extraction to commit
            rec["shard_wait"] = shard_wait_s / max(step_s, 1e-9)
        if self.peak:
            rec["mfu"] = self.flops / max(step_s, 1e-9) / self.peak
        peak_mem_gib = self.peak_mem_gib() if peak_mem_gib is None else peak_mem_gib
        if peak_mem_gib is not None:
            rec["peak_mem_gib"] = peak_mem_gib
        if not self.enabled:
            return rec
        line = (f"step {step + 1}/{self.total} ep {epoch} loss {rec['loss']:.4f} acc {rec['acc']:.3f} "
                f"tau {rec['tau']:.2f} (walk {rec.get('tau_walk', math.nan):.2f}) lr {lr:.2e} "
                f"gnorm {grad_norm:.2f} | {rec['tok_s']:,.0f} tok/s "
                f"{rec['step_s'] * 1000:.0f} ms/step data-wait {rec['data_wait']:.0%}")
        if "mfu" in rec:
            line += f" MFU {rec['mfu']:.1%}"
        if "peak_mem_gib" in rec:
            line += f" mem {rec['peak_mem_gib']:.1f}GiB"
        line += f" | ETA {_fmt(eta)}"
        print(line, flush=True)
        append_durably(self.history_path, (json.dumps(rec) + "\n").encode(), fsync=False)
        self._tensorboard("train/", {k: v for k, v in rec.items() if k not in ("step", "epoch", "time")}, step)
        return rec

    def _tensorboard(self, prefix: str, scalars: dict, step: int) -> None:
        """TensorBoard is a nice-to-have: a failing write (disk full) warns once and turns it off for
        the rest of the run instead of stopping training (metrics.jsonl keeps every record)."""
        if self.tb is None:
            return
        try:
            for k, v in scalars.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(prefix + k, v, step)
        except Exception as exc:  # noqa: BLE001 - the event writer thread re-raises its OSError here
            log.warning("TensorBoard writes to %s failed (%s); continuing without TensorBoard",
                        self.out_dir / "tensorboard", exc)
            self._close_tensorboard()

    def log_validation(self, step: int, metrics: dict) -> dict:
        """One validation pass: a log line, `val_metrics.jsonl`, TensorBoard `val/*`."""
        rec = {"step": step, **metrics}
        if not self.enabled or not metrics:
            return rec
        print(f"val  {step + 1}/{self.total} loss {metrics['val_loss']:.4f} acc {metrics['val_acc']:.3f} "
              f"tau {metrics['val_tau']:.2f} (walk {metrics.get('val_tau_walk', math.nan):.2f})", flush=True)
        append_durably(self.out_dir / "val_metrics.jsonl", (json.dumps(rec) + "\n").encode(), fsync=False)
        self._tensorboard("val/", {k[4:]: v for k, v in metrics.items()}, step)
        return rec

    def _close_tensorboard(self) -> None:
        tb, self.tb = self.tb, None
        try:
            tb.close()
        except Exception:  # noqa: BLE001 - the flush of a full disk fails again; already warned
            pass

    def close(self) -> None:
        if self.tb is not None:
            self._close_tensorboard()


def _fmt(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def plot_history(history_path: Path, out_png: Path) -> Path | None:
    """Loss curve and per-position acceptance (accuracy of slot k, last quarter of training)."""
    if not history_path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in history_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] + 1 for r in recs]
    a1.plot(steps, [r["loss"] for r in recs], label="loss")
    a1.set_xlabel("step")
    a1.set_ylabel("weighted CE (log scale)")
    a1.set_yscale("log")
    a1b = a1.twinx()
    a1b.plot(steps, [r["tau"] for r in recs], color="tab:orange", label="simulated tau")
    a1b.set_ylabel("simulated acceptance length tau")
    a1.set_title("training loss and simulated tau")
    tail = recs[-max(1, len(recs) // 4):]
    ks = sorted(int(k.split("_")[1]) for k in recs[-1] if k.startswith("acc_"))
    acc = [sum(r.get(f"acc_{k}", 0.0) for r in tail) / len(tail) for k in ks]
    a2.bar(ks, acc)
    a2.set_xlabel("block position k")
    a2.set_ylabel("accuracy (last quarter of steps)")
    a2.set_title("per-position acceptance")
    fig.tight_layout()
    ok = write_optional(out_png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "training plot")
    plt.close(fig)
    return out_png if ok else None
