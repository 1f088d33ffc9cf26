"""Small-M linear layers: pick the fastest formulation of ``y = x @ W.T + b`` per shape, timed once on CUDA.

At batch 1 the engine's projections run with M = 1 (a decode step) or M = 16 (a verify block) rows.
cuBLAS's default fp32 kernel for M = 16 tiles N by 128 columns: a 576-wide projection is a handful of
CTAs on a 132-SM H200, ~50 us a call where the weights alone would stream in ~1 us. The candidates
(`CANDIDATES`) compute the same product in other ways (a pre-transposed weight copy, W @ x.T,
split-K as one batched matmul plus a sum, N in chunks, addmm, one batched matmul of M single rows
over the shared weight, the cuBLASLt backend); all are plain
fp32 (TF32 stays as the user set it, and is reported: with it on, nothing here is exact).

`LinearChooser.choose(W, b, rows)` times every candidate on the real weight at M = `rows`, each as a
CUDA graph of `REPS` calls (what the engine replays), and keeps the fastest that matches a float64
reference; `F.linear` wins unless another is at least `MIN_GAIN` faster (no flip-flop on noise).
Choices are cached per (device, dtype, N, K, M, bias) for the process, so a rebuilt engine does not
re-time. On the CPU (or ``mode='linear'``) the choice is always `F.linear`, with no timing.
A candidate that needs a copy of the weight (the transposed one) is only timed while the copies
kept stay under `max_copy_bytes` (an 8B model's weights are not doubled by it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

log = logging.getLogger("dflash_pipe.target")

REPS = 20              # calls per timed graph
MIN_GAIN = 0.05        # a candidate must beat F.linear by this fraction to replace it
MODES = ("auto", "linear")


@contextmanager
def blas_backend(name: str):
    """Run the body with `torch.backends.cuda.preferred_blas_library(name)`, then put the old one back."""
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


def _add(y, b):
    return y if b is None else y + b


def _linear(x, W, b, extra):
    return F.linear(x, W, b)


def _mm_t(x, W, b, extra):                       # extra = W.t().contiguous(), [K, N]
    return torch.mm(x, extra) if b is None else torch.addmm(b, x, extra)


def _w_x(x, W, b, extra):
    return _add(torch.mm(W, x.t()).t().contiguous(), b)


def _addmm(x, W, b, extra):                      # extra = the bias or zeros [N]
    return torch.addmm(extra, x, W.t())


def _split_k(s):
    def run(x, W, b, extra):
        M, K = x.shape
        N = W.shape[0]
        xs = x.view(M, s, K // s).transpose(0, 1)                   # [s, M, K/s]
        ws = W.view(N, s, K // s).permute(1, 2, 0)                  # [s, K/s, N] (strided, no copy)
        return _add(torch.bmm(xs, ws).sum(0), b)
    return run


def _chunks_n(c):
    def run(x, W, b, extra):
        n = W.shape[0] // c
        return torch.cat([F.linear(x, W[i * n:(i + 1) * n], None if b is None else b[i * n:(i + 1) * n])
                          for i in range(c)], dim=-1)
    return run


def _rows_bmm(x, W, b, extra):                   # M one-row products in one batched call, W shared (stride 0)
    M, K = x.shape
    return _add(torch.bmm(x.unsqueeze(1), W.t().unsqueeze(0).expand(M, K, W.shape[0])).squeeze(1), b)


def _cublaslt(x, W, b, extra):
    with blas_backend("cublaslt"):
        return F.linear(x, W, b)


# name -> (function, applies(N, K, device) , needs a transposed weight copy)
CANDIDATES: dict[str, tuple[Callable, Callable, bool]] = {
    "linear": (_linear, lambda N, K, d: True, False),
    "mm_t": (_mm_t, lambda N, K, d: True, True),
    "w_x": (_w_x, lambda N, K, d: True, False),
    "addmm": (_addmm, lambda N, K, d: True, False),
    "split_k4": (_split_k(4), lambda N, K, d: K % 4 == 0, False),
    "split_k8": (_split_k(8), lambda N, K, d: K % 8 == 0, False),
    "split_k16": (_split_k(16), lambda N, K, d: K % 16 == 0, False),
    "chunks_n2": (_chunks_n(2), lambda N, K, d: N % 2 == 0, False),
    "chunks_n4": (_chunks_n(4), lambda N, K, d: N % 4 == 0, False),
    "rows_bmm": (_rows_bmm, lambda N, K, d: N * K <= 1 << 22, False),   # bounded in case bmm copies the expand
    "cublaslt": (_cublaslt, lambda N, K, d: d.type == "cuda" and torch.version.hip is None, False),
}

_CACHE: dict[tuple, tuple[str, dict]] = {}      # (device, dtype, N, K, M, bias) -> (winner, {name: us})


def tf32_on() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def extra_for(name: str, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor candidate `name` needs beside W (made once per weight)."""
    if name == "mm_t":
        return W.detach().t().contiguous()
    if name == "addmm":
        return b.detach() if b is not None else W.new_zeros(W.shape[0])
    return None


def _graph_time_us(fn, x, W, b, extra) -> float:
    """Microseconds per call: REPS calls captured in one CUDA graph, replayed 3 times, timed by events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x, W, b, extra)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn(x, W, b, extra)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (3 * REPS)


class LinearChooser:
    """Per-shape formulation of the engine's linear layers (module docstring)."""

    def __init__(self, device: torch.device, mode: str = "auto", max_copy_bytes: int = 2 << 30):
        if mode not in MODES:
            raise ValueError(f"linear mode must be one of {MODES}, got {mode!r}")
        self.device, self.mode, self.max_copy_bytes = device, mode, max_copy_bytes
        self.copy_bytes = 0
        self.tuned_s = 0.0
        self.table: dict[tuple, tuple[str, dict]] = {}

    @property
    def active(self) -> bool:
        return self.mode == "auto" and self.device.type == "cuda"

    def choose(self, W: torch.Tensor, b: torch.Tensor | None, rows: int, copies: int = 1) -> str:
        """The candidate for x [rows, K] @ W.T (+ b); `copies` = how many weights of this shape would need
        a copy if the winner wants one (the engine's layer count)."""
        if not self.active:
            return "linear"
        N, K = W.shape
        key = (str(self.device), W.dtype, N, K, rows, b is not None)
        if key not in _CACHE:
            t0 = time.perf_counter()
            _CACHE[key] = self._time(W, b, rows, copies)
            self.tuned_s += time.perf_counter() - t0
        name, times = _CACHE[key]
        if CANDIDATES[name][2]:
            need = copies * N * K * W.element_size()
            if self.copy_bytes + need > self.max_copy_bytes:      # over the copy budget: the best without one
                name = min((n for n in times if not CANDIDATES[n][2]), key=lambda n: times[n])
            else:
                self.copy_bytes += need
        self.table[key] = (name, times)
        return name

    @torch.no_grad()
    def _time(self, W, b, rows, copies) -> tuple[str, dict]:
        N, K = W.shape
        g = torch.Generator(device=W.device).manual_seed(0)
        x = torch.randn((rows, K), generator=g, device=W.device, dtype=W.dtype)
        cols = torch.linspace(0, N - 1, min(N, 1024), device=W.device).long()    # spread over N (chunks), cheap
        ref = x.double() @ W[cols].double().t() + (0 if b is None else b[cols].double())
        tol = 1e-4 if W.dtype == torch.float32 else 2e-2
        times: dict[str, float] = {}
        for name, (fn, applies, needs_copy) in CANDIDATES.items():
            if not applies(N, K, W.device):
                continue
            if needs_copy and self.copy_bytes + copies * N * K * W.element_size() > self.max_copy_bytes:
                continue
            extra = extra_for(name, W, b)
            try:
                got = fn(x, W, b, extra)[:, cols].double()
                err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                if err > tol:
                    log.warning("linear candidate %s at M=%d N=%d K=%d: rel. error %.2e, not used", name, rows, N, K, err)
                    continue
                times[name] = _graph_time_us(fn, x, W, b, extra)
            except Exception as exc:  # noqa: BLE001 - a candidate this torch/GPU cannot run is skipped
                log.info("linear candidate %s at M=%d N=%d K=%d unavailable: %s", name, rows, N, K, exc)
        best = min(times, key=lambda n: times[n])
        if "linear" in times and times[best] > (1 - MIN_GAIN) * times["linear"]:
            best = "linear"
        log.info("linear M=%d N=%d K=%d%s: %s (%s)", rows, N, K, " +bias" if b is not None else "", best,
                 ", ".join(f"{n} {t:.1f}us" for n, t in sorted(times.items(), key=lambda kv: kv[1])))
        return best, times

    def summary(self) -> list[dict]:
        """One row per tuned shape: the winner and every candidate's us per call (for bench JSON)."""
        return [{"M": k[4], "N": k[2], "K": k[3], "bias": k[5], "dtype": str(k[1]), "choice": name,
                 "us": {n: round(t, 2) for n, t in times.items()}} for k, (name, times) in self.table.items()]
