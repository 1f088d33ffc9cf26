"""The n-gram table all rows of `regenerate --lookup-draft K` share (eval/regen_lookup.py, `--lookup-shared`).

A row's own history finds no earlier occurrence of its last token in a third of the steps (SmolLM2-135M, H100
run of session 33: 0.672 of the live row-steps found one), and then its drafts are wasted. Other answers often
hold the phrase: answers to different prompts share openings, list markup, code idioms. So every kept token also
goes into a table shared by all rows: for each n = 1..3, the n tokens ending at a position of an answer map to
the K tokens that followed them there, the latest occurrence winning. A row's drafts come from the table when it
holds a longer match than the row's own history (on a tie the row's own continuation wins).

On the device the table is hashed: an n-gram's tokens combine into one exact int64 key (`MIX`-ary digits; tokens
of a vocabulary beyond MIX merely collide), and into its slot, sum(token_i * a_i) mod a prime P (random a_i: the
MIX-ary key mod P would put (t0, t1) and (t0 - 7, t1 - 4) in one slot), in the region of its length n; the slot
holds the key (to tell a collision from a hit) and the K tokens. Writes of one step that land on the same slot
race on CUDA, and a slot may end up with one writer's key and another's tokens: that costs a rejected draft,
never a wrong answer, since a draft is kept only where the target's own choice equals it.

Simulated first on 106 greedy SmolLM2-135M answers (CPU, `bench/lookup_sim.py --shared`): 1.665 -> 1.775 tokens
kept a row-step at K = 2, and the gain grew with the answers seen (+4 %, +6 %, +9 % over thirds of the set).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

MAX_N = 3                   # n-gram lengths 1..MAX_N
MIX = 1 << 18               # digit base of a key: tokens below it never collide before hashing


def prime_at_least(n: int) -> int:
    """The smallest prime >= n (n up to a few million: trial division is instant)."""
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def multipliers(P: int) -> list[int]:
    """The slot hash's a_i for tables of P slots: 1 for the last token (a token below P has a slot of its own),
    then fixed pseudo-random residues."""
    rng = random.Random(P)
    return [1] + [rng.randrange(P // 4, P) for _ in range(MAX_N - 1)]


def table_size(batch: int, max_len: int) -> int:
    """Slots per n-gram length: the tokens the slots can hold at once, between 4 Ki and 1 Mi (a prime)."""
    return prime_at_least(min(1 << 20, max(1 << 12, 2 * batch * max_len)))


class SharedNgrams:
    """The hashed table on the device (module docstring): `lookup` for drafting, `record` after each step."""

    def __init__(self, k: int, slots: int, device: torch.device):
        self.k, self.P = k, prime_at_least(slots)
        self.spare = MAX_N * self.P                      # a slot no lookup reads: the writes that don't count
        with torch.inference_mode():
            self.keys = torch.full((self.spare + 1,), -1, dtype=torch.long, device=device)
            self.vals = torch.zeros((self.spare + 1, k), dtype=torch.long, device=device)
            self.ar_n = torch.arange(MAX_N, device=device)                    # n - 1
            self.digits = MIX ** self.ar_n                                    # key = sum of token_i * MIX^i
            self.mult = torch.tensor(multipliers(self.P), device=device)      # slot = sum of token_i * a_i mod P
            self.region = self.ar_n * self.P
            self.ar_k = torch.arange(k, device=device)
            self.ar_T = torch.arange(k + 1, device=device)                    # the positions a step may keep

    def _slots(self, tails: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and slots of the n-grams whose tokens, last first, are `tails` [..., MAX_N]: entry n - 1 is the
        n-gram of length n; `ok` false sends it to the spare slot."""
        keys, mixed = (tails * self.digits).cumsum(dim=-1), (tails * self.mult).cumsum(dim=-1)
        return keys, torch.where(ok, mixed % self.P + self.region, self.spare)

    def lookup(self, hist: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows whose history is `hist` [w, L] with its last token at `last` [w]: the length of the longest
        n-gram ending there that the table holds ([w], 0 = none) and its K tokens ([w, K])."""
        back = last[:, None] - self.ar_n                                      # [w, MAX_N]
        keys, slot = self._slots(hist.gather(1, back.clamp(min=0)), back >= 0)
        hit = (self.keys[slot] == keys) & (back >= 0)           # the spare slot holds the writes that don't count
        n = torch.where(hit, self.ar_n + 1, 0).max(dim=1).values
        best = slot.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        return n, self.vals[best]

    def record(self, hist: torch.Tensor, old_len: torch.Tensor, kept: torch.Tensor) -> None:
        """Rows whose history `hist` [w, L] grew from `old_len` by `kept` tokens ([w], 0..T with T = K + 1): the
        n-grams ending at old_len - K .. old_len - K + kept - 1 now have their K followers; record them."""
        j, T = self.ar_T, self.k + 1
        end = old_len[:, None] - self.k + j                                   # [w, T]: the n-gram's last token
        back = end[..., None] - self.ar_n                                     # [w, T, MAX_N]
        w = hist.shape[0]
        tails = hist.gather(1, back.clamp(min=0).view(w, -1)).view(w, T, MAX_N)
        ok = (j < kept[:, None])[..., None] & (back >= 0)
        keys, slot = self._slots(tails, ok)
        after = (end[..., None] + 1 + self.ar_k).clamp(0, hist.shape[1] - 1)   # [w, T, K]
        follow = hist.gather(1, after.view(w, -1)).view(w, T, 1, self.k).expand(w, T, MAX_N, self.k)
        self.keys.index_put_((slot.reshape(-1),), keys.reshape(-1))
        self.vals.index_put_((slot.reshape(-1),), follow.reshape(-1, self.k))


class SharedNgramsReference:
    """The table in plain Python (tests, bench/lookup_sim.py): the same writes in the same order (row, then
    position, then n), the last one winning. Unhashed by default; with `P`, hashed as the device's table is (a
    slot holds one n-gram: a colliding write evicts it)."""

    def __init__(self, k: int, P: int | None = None):
        self.k, self.P, self.table = k, P, {}
        self.mult = multipliers(P) if P else None

    def _slot(self, gram: tuple[int, ...]):
        if self.P is None:
            return gram
        return (len(gram) - 1) * self.P + sum(t * a for t, a in zip(reversed(gram), self.mult)) % self.P

    def record(self, history: Sequence[int], old_len: int) -> None:
        h = list(history)
        for end in range(old_len - self.k, len(h) - self.k):
            for n in range(1, MAX_N + 1):
                if end - n + 1 >= 0:
                    gram = tuple(h[end - n + 1:end + 1])
                    self.table[self._slot(gram)] = (gram, h[end + 1:end + 1 + self.k])

    def lookup(self, history: Sequence[int]) -> tuple[int, list[int] | None]:
        """(n, its K tokens) of the longest n-gram ending the history that the table holds; (0, None) if none."""
        h = list(history)
        for n in range(min(MAX_N, len(h)), 0, -1):
            gram = tuple(h[-n:])
            got = self.table.get(self._slot(gram))
            if got is not None and got[0] == gram:
                return n, got[1]
        return 0, None
