"""Acceptance evaluation (real speculative decoding) and target-side data regeneration.

Public API (see each module's docstring):
  target_step.py  TargetVerifier, FeatureCapture, greedy_generate, resolve_cache_mode
                  (recurrent_state.py: the hybrid cache's snapshot/restore for the 'rollback' mode)
                  (gdn_refeed.py: the rollback's state-only re-feed, --rollback-refeed states)
  engine_step.py  EngineVerifier, engine_greedy_generate: the same on the static-KV engine (CUDA graphs)
  draft_graph.py  GraphedDFlashProposer: the DFlash drafting step at fixed shapes (CUDA graphs)
  specdecode.py   speculative_generate, SpecResult, DFlashProposer, make_dflash_verifier, eos_token_ids
  ngram.py        NgramProposer, ngram_propose
  runner.py       run_eval(cfg)                     -> `dflash-pipe eval`
                  (reference_batch.py: a set's target-only references by continuous batching, --reference;
                   generation.py: one generation's method runs and report row)
  regenerate.py   run_regenerate(cfg, output, ...)  -> `dflash-pipe regenerate`
                  (regen_backends.py: continuous batching on the static-KV engine / HF generate;
                   regen_sampling.py: batch-independent sampling; regen_output.py: JSONL + sidecar)
"""

from .ngram import NgramProposer, ngram_propose
from .specdecode import DFlashProposer, SpecResult, eos_token_ids, make_dflash_verifier, speculative_generate
from .target_step import FeatureCapture, TargetVerifier, greedy_generate, resolve_cache_mode

__all__ = [
    "DFlashProposer", "FeatureCapture", "NgramProposer", "SpecResult", "TargetVerifier", "eos_token_ids",
    "greedy_generate", "make_dflash_verifier", "ngram_propose", "resolve_cache_mode", "speculative_generate",
]
