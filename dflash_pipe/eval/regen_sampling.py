"""Next-token choice for `regenerate`: greedy, or temperature / top-p sampling that batching cannot change.

Each answer has a 62-bit key derived from (seed, sample id, turn) on the host; step s of that
answer draws one uniform u = hash(key, s) in [0, 1) with integer arithmetic on the device, and
takes the token where the (top-p-cut, renormalised) cumulative distribution first exceeds u
(inverse-CDF sampling). So a row's randomness depends on nothing but its own key and step: not on
which other rows share its batch, which slot it sits in, or the device (the hash is exact integer
math on CPU and CUDA alike). No generator state, no host sync.

With ``--greedy-after K`` only steps 0..K-1 are sampled and every later token is the argmax:
diverse answers whose continuations are the target's own greedy choices. A block-parallel drafter
cannot see the sampled tokens inside the block it drafts, so fully sampled answers give it labels
that are partly noise (session 13's drafter, trained on fully sampled multi-turn answers, decoded
5.5 % below session 6's, trained on greedy first turns, with other things changed as well).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..errors import UsageError

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Decoding:
    """The decoding settings recorded in the sidecar (temperature 0 = greedy)."""

    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    greedy_after: int = 0   # > 0: only an answer's first `greedy_after` tokens are sampled, the rest are greedy
    first_sample: int = 0   # sample ids first_sample .. first_sample + samples - 1 (more answers in another file)

    def validate(self) -> "Decoding":
        if self.samples < 1:
            raise UsageError(f"--samples must be >= 1, got {self.samples}")
        if self.first_sample < 0:
            raise UsageError(f"--first-sample must be >= 0, got {self.first_sample}")
        if self.first_sample and self.temperature == 0:
            raise UsageError(f"--first-sample {self.first_sample} asks for more sampled answers, but --temperature 0 "
                             "would repeat the greedy answer", "pass --temperature > 0 (the first file's settings)")
        if not self.temperature >= 0:
            raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.greedy_after < 0:
            raise UsageError(f"--greedy-after must be >= 0 (0 = sample every token), got {self.greedy_after}")
        if self.greedy_after and self.temperature == 0:
            raise UsageError(f"--greedy-after {self.greedy_after} samples the first tokens of each answer, which "
                             "needs --temperature > 0", "pass --temperature (e.g. 1.0), or drop --greedy-after")
        if self.samples > 1 and self.temperature == 0:
            raise UsageError(f"--samples {self.samples} with --temperature 0 would write {self.samples} identical "
                             "greedy answers per prompt", "pass --temperature > 0 (e.g. 0.7) or --samples 1")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample_ids(self, base: str) -> list[str]:
        """The row ids of one conversation: `base` alone for one greedy-style answer, else `base#k`."""
        if self.samples == 1 and not self.first_sample:
            return [base]
        return [f"{base}#{k}" for k in range(self.first_sample, self.first_sample + self.samples)]

    def settings(self) -> dict:
        out = {"samples": self.samples, "temperature": float(self.temperature), "top_p": float(self.top_p),
               "seed": self.seed}
        if self.greedy_after:               # absent when 0: sidecars from before the flag resume unchanged
            out["greedy_after"] = self.greedy_after
        if self.first_sample:               # likewise
            out["first_sample"] = self.first_sample
        return out


def answer_key(seed: int, sample_id: str, turn: int) -> int:
    """The 62-bit key of one answer (sample ids already carry the sample index)."""
    h = hashlib.blake2b(f"{seed}\x00{sample_id}\x00{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row from (key, step), int64 [B] each."""
    h = _mix32(keys ^ _mix32(steps + 0x9E3779B9))
    h = _mix32(h ^ (keys >> 32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def next_tokens(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, dec: Decoding) -> torch.Tensor:
    """The chosen token of every row of `logits` [B, V] (long [B]); `steps` [B] is each row's token index in its
    answer. With `dec.greedy_after` = K the rows at step >= K take the argmax (no host sync: both are computed)."""
    if dec.greedy:
        return logits.argmax(dim=-1)
    tok = _sampled(logits, keys, steps, dec)
    if dec.greedy_after:
        tok = torch.where(steps < dec.greedy_after, tok, logits.argmax(dim=-1))
    return tok


def _sampled(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, dec: Decoding) -> torch.Tensor:
    probs = torch.softmax(logits.float() / dec.temperature, dim=-1)
    u = uniforms(keys, steps)
    V = probs.shape[-1]
    if dec.top_p < 1:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)
        before = sp.cumsum(dim=-1) - sp
        sp = sp * (before < dec.top_p)                       # the smallest prefix holding top_p (>= 1 token)
        cdf = sp.cumsum(dim=-1)
        j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)
        return si.gather(1, j)[:, 0]
    cdf = probs.cumsum(dim=-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)
    return j[:, 0]
