"""Shared pieces of the eval tests: a tiny target whose greedy output is not degenerate, drafters, oracles.

The tiny-llama preset at its default init (std 0.02) greedily repeats one token forever, which
would make "identical output" checks vacuous. `liven` redraws every matrix with a larger std
(seeded), so the greedy continuation changes token by token and depends on the prompt.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.drafter import DFlashDrafter, DrafterModelConfig

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about speculative decoding."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this\n"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name three prime numbers."}],
]


def liven(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)
    return model


def tiny_drafter(block_size: int = 4, layer_ids=(1, 3, 7), hidden: int = 64, num_target_layers: int = 8,
                 seed: int = 0, num_layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 intermediate: int = 128, vocab: int = 49152):
    cfg = DrafterModelConfig(hidden_size=hidden, num_layers=num_layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                             rms_norm_eps=1e-6, rope_theta=1e4, block_size=block_size, mask_token_id=vocab - 1,
                             target_layer_ids=list(layer_ids), num_target_layers=num_target_layers, vocab_size=vocab)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, attention="sdpa"), cfg


def drain_backend(be, prompts: list[list[int]], sync_each: bool = False, strict: bool = False,
                  key_offset: int = 0) -> dict:
    """Every prompt through a regenerate engine backend (order = its index, sampling key = key_offset + index):
    {order: (answer tokens, ended by EOS, the EOS token)}, each answer once. On CUDA, `sync_each` synchronizes the
    device before each launch and `strict` runs each launch under sync-debug 'error' (collect waits for the
    device by design)."""
    from dflash_pipe.eval.regen_backends import TurnRequest

    ready = [TurnRequest(None, p, key=key_offset + i, order=i) for i, p in enumerate(prompts)]
    got = {}
    while ready or be.busy():
        if sync_each:
            torch.cuda.synchronize()
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            be.launch(ready)
        finally:
            if strict:
                torch.cuda.set_sync_debug_mode(0)
        for c in be.collect():
            assert c.request.order not in got
            got[c.request.order] = (c.tokens, c.ended, c.end_token)
    be.close()                            # overlap mode: the last launch's final step may still be queued
    return got


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """The independent reference: transformers' own greedy generate."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
                           pad_token_id=eos_ids[0])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=device), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


class CorruptingOracle:
    """Drafts the true greedy continuation, but makes draft number `wrong_at(step)` wrong.

    With `wrong_at` returning >= B every step it is a perfect oracle. `expected` records, per
    step, how many drafts must be accepted (the correct prefix, bounded by the budget).
    """

    def __init__(self, full_sequence: list[int], wrong_at, vocab: int, needs_features: bool = False):
        self.full = full_sequence
        self.wrong_at = wrong_at
        self.vocab = vocab
        self.needs_features = needs_features
        self.step = 0
        self.expected: list[int] = []
        self.seen: list[tuple[list[int], torch.Tensor | None]] = []

    def propose(self, tokens, features, num):
        p = len(tokens) - 1
        self.seen.append((list(tokens), None if features is None else features[:p].clone()))
        drafts = list(self.full[len(tokens):len(tokens) + num])
        j = self.wrong_at(self.step)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % self.vocab
        self.expected.append(min(j, len(drafts)))
        self.step += 1
        return drafts


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny random Llama target with weights redrawn so its greedy output varies (see `liven`)."""
    from dflash_pipe.target import load_target

    bundle = load_target("random:tiny-llama", dtype="float32",
                         model_cache_dir=tmp_path_factory.getbasetemp() / "dflash-model-cache")
    liven(bundle.model)
    return bundle
