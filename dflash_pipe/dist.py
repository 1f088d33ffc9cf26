"""Process-group and device plumbing shared by both stages (torchrun or a single process).

Under torchrun every rank reads RANK / WORLD_SIZE / LOCAL_RANK. Each rank gets its own Triton
and TorchInductor cache directory on local disk: FLA's Triton autotuner is not safe to share
between processes, and a half-written shared cache is a known source of corrupted kernels.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass

import torch

from .errors import UsageError

log = logging.getLogger("dflash_pipe.dist")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "DistInfo":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def set_rank_cache_dirs(info: DistInfo, stage: str) -> None:
    """Per-rank TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR unless the user set them (before torch._inductor's
    import wrote its default into the environment: `dflash_pipe.USER_KERNEL_CACHE_ENV`)."""
    from . import USER_KERNEL_CACHE_ENV
    base = os.environ.get("DFLASH_LOCAL_CACHE", os.path.join(tempfile.gettempdir(), "dflash-pipe-kernels"))
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        if USER_KERNEL_CACHE_ENV[var] is None:
            path = os.path.join(base, f"{stage}-rank{info.rank}", sub)
            os.makedirs(path, exist_ok=True)
            os.environ[var] = path


DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_CUDA_SPEC = re.compile(r"cuda(?::(\d+))?")


def check_device(spec: str, flag: str) -> str:
    """Refuse a device value no stage can use, before anything loads: the one check behind every command's device
    flag. Accepts 'auto', 'cpu', 'cuda' and 'cuda:N' (N one of the visible GPUs; 'cuda' needs one). `flag` names
    where the value came from (e.g. "--device / [eval] device"). Returns spec unchanged; raises UsageError."""
    if spec in ("auto", "cpu"):
        return spec
    m = _CUDA_SPEC.fullmatch(spec)
    if m is None:
        raise UsageError(f"{flag} '{spec}' is not a device", f"use {DEVICE_FORMS}")
    if not torch.cuda.is_available():
        raise UsageError(f"{flag} '{spec}' asks for a CUDA GPU, but no CUDA GPU is visible",
                         "use auto or cpu, or check CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= count:
        raise UsageError(f"{flag} '{spec}': only {count} CUDA GPU(s) are visible",
                         f"use cuda:0 .. cuda:{count - 1}, or check CUDA_VISIBLE_DEVICES")
    return spec


def pick_device(spec: str, info: DistInfo, flag: str = "--device") -> torch.device:
    """'auto' -> the local rank's GPU if there is one, else CPU; 'cuda' -> the local rank's GPU. Anything
    check_device refuses is a UsageError naming `flag`."""
    check_device(spec, flag)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda":
        spec = f"cuda:{info.local_rank % torch.cuda.device_count()}"
    dev = torch.device(spec)
    torch.cuda.set_device(dev)
    return dev


def init_process_group(info: DistInfo, device: torch.device, timeout_s: float = 1800) -> bool:
    """Initialise torch.distributed when world > 1 (NCCL on GPU, gloo on CPU). Returns whether it did."""
    import torch.distributed as dist

    if info.world <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return True


def agree_on_plan(epoch_steps: list[int], device: torch.device) -> list[int]:
    """Every rank's steps per epoch, made one plan (each epoch's minimum over the ranks). With --follow each rank
    counts the shards committed when it looks, and a shard that lands between two ranks' looks would give them
    different LR curves: DDP averages the gradients, but each rank's AdamW would apply its own lr and the replicas
    drift apart. Every rank calls this (a collective when world > 1)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return epoch_steps
    t = torch.tensor(epoch_steps, dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(x) for x in t.tolist()]


def all_ranks_say(key: str, value: str, wait_s: float, poll_s: float = 0.2) -> bool:
    """Whether every rank says `value` under `key` within `wait_s`, agreed through the job's rendezvous store
    rather than a collective: a rank stuck in a collective (e.g. the next step's gradient all-reduce) cannot take
    part in one, and then this returns False after `wait_s` instead of hanging. Each rank writes once, so every
    rank that sees all of them sees the same values. True at once with one process."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    try:   # the job's store (torchrun's rendezvous); private in torch 2.x: without it, no agreement
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    except (ImportError, RuntimeError, ValueError) as exc:
        log.warning("no rendezvous store to agree on %s (%s)", key, exc)
        return False
    world = dist.get_world_size()
    store.set(f"{key}/{dist.get_rank()}", value)
    keys = [f"{key}/{r}" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return all(store.get(k).decode() == value for k in keys)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """Tear the process group down. On gloo, first hand the GIL to its worker threads for a moment:
    a finished barrier work still holds the earlier works (and their Python-owned tensors) until its
    worker thread drops it, which needs the GIL; destroy_process_group joins those threads while
    holding the GIL, so a rank that reaches it right after a barrier can deadlock (seen in CI on the
    rank with nothing to do between its last barrier and exit; pytorch/pytorch#190489, #56297)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            time.sleep(0.2)  # sleeping releases the GIL; the workers finish dropping their works
        dist.destroy_process_group()
