"""The eval's target side on the static-KV engine (attention-only targets): no per-token Python work.

`EngineTarget` owns one `StaticKVEngine` (target/static_forward.py: preallocated K/V, CUDA graphs
per shape on CUDA, eager on the CPU) for the whole eval, batch 1, capturing the union of every
drafter's `target_layer_ids`; the methods run one after the other on its row 0.

`EngineVerifier` has `TargetVerifier`'s interface (prefill / verify / commit / features, same
invariant: the cache holds tokens 0..p-1) with mode 'static':
  * verify feeds a fixed-width block of `block_size` tokens, [token p, drafts, padding], with
    ``num_new`` = the real count, so every verify of an eval replays the same graph (per attended
    length bucket); padded positions are masked by causality and overwritten later;
  * commit is ``truncate(0, p + 1 + accepted)``: only the row's length moves;
  * the captured layers' outputs of the real tokens go to the feature buffer, in the drafter's
    layer order.
`engine_greedy_generate` is the target-only baseline on the same engine: one graphed T=1 step per
token, each step fed the previous step's argmax on the device; the host reads token i after
launching step i + 1, so the only host wait per token overlaps the GPU, and an EOS costs one spare
step (its output is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UsageError
from ..target.static_forward import StaticKVEngine, engine_support

ENGINES = ("auto", "static", "hf")


def resolve_engine(model: torch.nn.Module, engine: str, device: torch.device) -> tuple[str, str]:
    """('static' | 'hf', why): auto = the static engine on CUDA for attention-only targets."""
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    why = engine_support(model)
    if engine == "static" and why is not None:
        raise UsageError(f"--engine static: {why}", "use --engine hf (or auto)")
    if engine == "hf":
        return "hf", "--engine hf"
    if why is not None:
        return "hf", why
    if engine == "auto" and device.type != "cuda":
        return "hf", "not on CUDA (--engine static runs the engine eagerly on the CPU)"
    return "static", "static KV" + (" + CUDA graphs" if device.type == "cuda" else " (eager)")


class EngineTarget:
    """The shared engine (module docstring); grows its buffers when a prompt needs more room."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], max_len: int, limit: int,
                 use_graphs: str = "auto", block_size: int = 16):
        self.model = model
        self.layer_ids = sorted(set(int(i) for i in layer_ids))
        self.limit = limit
        self.use_graphs = use_graphs
        self.tune_rows = (1, block_size)             # GEMM shapes timed: decode steps and verify blocks
        self.device = next(model.parameters()).device
        self.hidden_size = int(model.config.hidden_size)
        self.engine = self._build(min(max_len, limit))

    def _build(self, max_len: int) -> StaticKVEngine:
        return StaticKVEngine(self.model, 1, max_len, capture_layer_ids=self.layer_ids, use_graphs=self.use_graphs,
                              tune_rows=self.tune_rows)

    def ensure(self, need: int) -> StaticKVEngine:
        """The engine, rebuilt with room for `need` tokens (doubling, up to the limit) if it has less."""
        if need > self.limit:
            raise UsageError(f"a generation needs {need} positions, the target has {self.limit}")
        if need > self.engine.max_len:
            old = self.engine.max_len
            self.engine = None                      # free the old buffers and graphs first
            self.engine = self._build(min(self.limit, max(need, 2 * old)))
        return self.engine

    def columns(self, layer_ids: Sequence[int]) -> torch.Tensor | None:
        """Columns of the engine's captured hidden states for `layer_ids` in that order (None = all, in order)."""
        ids = [int(i) for i in layer_ids]
        if ids == self.layer_ids:
            return None
        H = self.hidden_size
        return torch.cat([torch.arange(self.layer_ids.index(i) * H, (self.layer_ids.index(i) + 1) * H)
                          for i in ids]).to(self.device)


class EngineVerifier:
    """`TargetVerifier` on the shared engine (module docstring)."""

    mode = "static"

    def __init__(self, target: EngineTarget, layer_ids: Sequence[int] = (), block_size: int = 16):
        missing = [i for i in layer_ids if i not in target.layer_ids]
        if missing:
            raise UsageError(f"engine captures layers {target.layer_ids}, not {missing}")
        self.target = target
        self.layer_ids = list(layer_ids)
        self.block_size = block_size
        self.device = target.device
        self._cols = target.columns(self.layer_ids) if self.layer_ids else None
        self.buffer: torch.Tensor | None = None
        self.tokens: list[int] = []
        self.forwards = self.refeeds = 0
        self._pending: list[int] = []

    @property
    def engine(self) -> StaticKVEngine:
        return self.target.engine

    @property
    def has_features(self) -> bool:
        return bool(self.layer_ids)

    def _write(self, hidden: torch.Tensor | None, offset: int, n: int) -> None:
        if self.buffer is None or hidden is None:
            return
        h = hidden[0, :n] if self._cols is None else hidden[0, :n].index_select(-1, self._cols)
        self.buffer[offset:offset + n].copy_(h)

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], feature_rows: int = 0) -> int:
        if not prompt_ids:
            raise UsageError("cannot generate from an empty prompt")
        self.tokens = [int(t) for t in prompt_ids]
        rows = max(feature_rows, len(self.tokens) + self.block_size)
        self.target.ensure(rows)
        self.engine.reset()
        self.forwards = self.refeeds = 0
        if self.layer_ids:
            width = len(self.layer_ids) * self.target.hidden_size
            self.buffer = torch.zeros((rows, width), dtype=self.engine.dtype, device=self.device)
        out = self.engine.forward(torch.tensor([self.tokens], device=self.device), last_only=True)
        self._write(out.hidden, 0, len(self.tokens))
        first = int(out.logits[0].argmax())
        self.forwards += 1
        self.tokens.append(first)
        return first

    @torch.inference_mode()
    def verify(self, drafts: Sequence[int]) -> list[int]:
        p = len(self.tokens) - 1
        fed = [self.tokens[p]] + [int(d) for d in drafts]
        n = len(fed)
        width = max(self.block_size, n)
        ids = torch.tensor([fed + [fed[-1]] * (width - n)])       # host tensors: the engine copies them through
        out = self.engine.forward(ids, num_new=torch.tensor([n]))  # pinned memory, no sync (a device= would sync)
        self._write(out.hidden, p, n)
        argmax = out.logits[0, :n].argmax(dim=-1).tolist()
        self.forwards += 1
        self._pending = fed
        return argmax

    def commit(self, accepted: int, bonus: int) -> None:
        fed = self._pending
        if not 0 <= accepted < len(fed):
            raise UsageError(f"commit: accepted {accepted} of {len(fed) - 1} drafts")
        p = len(self.tokens) - 1
        if accepted < len(fed) - 1:
            self.engine.truncate(0, p + 1 + accepted)
        self.tokens.extend(fed[1:1 + accepted])
        self.tokens.append(int(bonus))
        self._pending = []

    def features(self) -> torch.Tensor:
        if self.buffer is None:
            raise UsageError("this verifier captures no features")
        return self.buffer

    def close(self) -> None:
        self.buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@torch.inference_mode()
def engine_greedy_generate(target: EngineTarget, prompt_ids: Sequence[int], max_new_tokens: int,
                           eos_ids: Sequence[int]) -> list[int]:
    """Target-only greedy decoding on the engine, one graphed T=1 step per token (module docstring)."""
    if not prompt_ids:
        raise UsageError("cannot generate from an empty prompt")
    eng = target.ensure(len(prompt_ids) + max_new_tokens + 1)
    eng.reset()
    device = target.device
    eos = set(int(e) for e in eos_ids)
    logits = eng.forward(torch.tensor([list(prompt_ids)], device=device), last_only=True).logits
    token = logits.argmax(dim=-1).view(1, 1)           # on the device
    out: list[int] = []
    while True:
        nxt = None
        if len(out) + 1 < max_new_tokens:               # launch the next step before reading this token
            nxt = eng.forward(token, last_only=True).logits.argmax(dim=-1).view(1, 1)
        t = int(token)
        out.append(t)
        if t in eos or nxt is None:
            return out
        token = nxt
