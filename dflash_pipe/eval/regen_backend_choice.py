"""Which backend runs a `regenerate` (regenerate.py): the static-KV engine where the target allows it, at the
largest batch that fits (halved on out-of-memory), else HF `generate`; the flags of both checked first."""

from __future__ import annotations

import gc
import logging

import torch

from ..errors import RuntimeFailure, UsageError
from ..target.static_forward import PREFILL_LAYOUTS, engine_support
from .regen_backends import EngineBackend, auto_batch_size
from .regen_hf import HFBackend
from .regen_sampling import Decoding

log = logging.getLogger("dflash_pipe.eval")
ENGINES = ("auto", "static", "hf")
ENGINE_ATTENTION = ("auto", "rows", "sdpa")


def make_backend(bundle, eos: list[int], pad: int, batch: int, max_len: int, max_new: int, dec: Decoding,
                 engine: str, attention: str = "auto", reuse_history: bool = False, overlap: bool = False,
                 compact: bool = False, prefill_layout: str = "auto", collect_early: int | None = None,
                 steps_per_launch: int = 8, lookup_draft: int | None = None, lookup_shared: bool = True):
    """The engine backend where the target allows it (halving `batch` on OOM), else HF generate."""
    if steps_per_launch < 1:
        raise UsageError(f"--steps-per-launch must be >= 1, got {steps_per_launch}")
    if collect_early is not None and not 0 <= collect_early <= steps_per_launch:
        raise UsageError(f"--collect-early must be from 0 to --steps-per-launch ({steps_per_launch}), "
                         f"got {collect_early}")
    if prefill_layout not in PREFILL_LAYOUTS:
        raise UsageError(f"--prefill-layout must be one of {', '.join(PREFILL_LAYOUTS)}, got {prefill_layout!r}")
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if attention not in ENGINE_ATTENTION:
        raise UsageError(f"--engine-attention must be one of {', '.join(ENGINE_ATTENTION)}, got {attention!r}")
    why = engine_support(bundle.model) if engine != "hf" else "--engine hf"
    if why is not None:
        if engine == "static":
            raise UsageError(f"--engine static: the static-KV engine cannot run this target ({why})",
                             "use --engine auto (HF generate fallback)")
        if not dec.greedy:
            raise UsageError(f"--temperature {dec.temperature}: sampling needs the static-KV engine, which cannot "
                             f"run this target ({why})", "regenerate greedily (--temperature 0)")
        return HFBackend(bundle.model, eos, pad, batch or auto_batch_size(bundle.model, max_len, 256), max_new,
                         why=why + "".join(f"; {flag} ignored: it needs the static-KV engine" for flag, on in
                                           (("--overlap-prefill", overlap), ("--compact-tail", compact),
                                            ("--collect-early", collect_early is not None),
                                            ("--steps-per-launch", steps_per_launch != 8),
                                            ("--lookup-draft", bool(lookup_draft))) if on))
    batch = batch or auto_batch_size(bundle.model, max_len)
    while True:
        try:
            return EngineBackend(bundle.model, eos, batch, max_len, max_new, dec, attention=attention,
                                 reuse_history=reuse_history, overlap=overlap, compact=compact,
                                 prefill_layout=prefill_layout, snapshot_lag=collect_early,
                                 check_every=steps_per_launch, lookup_draft=lookup_draft,
                                 lookup_shared=lookup_shared)
        except torch.OutOfMemoryError:
            batch = halve_batch(batch)


def halve_batch(batch: int) -> int:
    if batch == 1:
        raise RuntimeFailure("out of GPU memory at --batch-size 1",
                             "use a smaller [extract] max_length in the manifest, or a larger GPU")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.warning("regenerate: out of GPU memory at batch %d; halving --batch-size to %d", batch, batch // 2)
    print(f"regenerate: out of GPU memory at batch {batch}; continuing at --batch-size {batch // 2}", flush=True)
    return batch // 2
