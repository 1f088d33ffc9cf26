"""regenerate's fallback backend: HF `generate` for targets the static-KV engine cannot run (regen_backends)."""

from __future__ import annotations

import torch

from .regen_requests import Completion, TurnRequest


class HFBackend:
    """Greedy left-padded HF `generate`, `batch` requests per call (the fallback)."""

    name = "HF generate"

    def __init__(self, model, eos: list[int], pad: int, batch: int, max_new_tokens: int, why: str = ""):
        self.model, self.eos, self.pad, self.B, self.max_new = model, eos, pad, batch, max_new_tokens
        self.device = next(model.parameters()).device
        self.describe = f"{self.name} (batch {batch}{'; ' + why if why else ''})"
        self.decode_steps = 0
        self._done: list[Completion] = []

    def busy(self) -> bool:
        return bool(self._done)

    def take_back(self) -> list[TurnRequest]:
        return []

    def close(self) -> None:
        """Nothing runs after `launch` returns."""

    def collect(self) -> list[Completion]:
        done, self._done = self._done, []
        return done

    def launch(self, ready: list[TurnRequest]) -> None:
        from transformers import GenerationConfig

        take = ready[:self.B]
        del ready[:len(take)]
        if not take:
            return
        prompts = [r.prompt for r in take]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):                  # left padding
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        gen = GenerationConfig(max_new_tokens=self.max_new, do_sample=False, eos_token_id=self.eos,
                               pad_token_id=self.pad)
        try:
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                          generation_config=gen)
        except torch.OutOfMemoryError:
            ready[:0] = take
            raise
        for req, row in zip(take, out[:, width:].tolist()):
            cut = next((i for i, t in enumerate(row) if t in self.eos), None)
            self._done.append(Completion(req, row[:cut] if cut is not None else row, cut is not None))
        self.decode_steps += out.shape[1] - width
