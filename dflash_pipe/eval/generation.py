"""One eval generation's pieces shared by the sequential and the batched-reference set runs (runner.py,
reference_batch.py): every method's speculative decode of a prompt, the warm-up, and its eval_prompts.jsonl row."""

from __future__ import annotations

from .specdecode import SpecResult, speculative_generate

WARMUP_TOKENS = 8


def record(set_name: str, gen_id: str, method: str, r: SpecResult | None, tokens: list[int],
           wall_s: float | None, reference: list[int]) -> dict:
    rec = {"set": set_name, "id": gen_id, "method": method, "generated": len(tokens), "wall_s": wall_s,
           "identical_to_target": tokens == reference}
    if r is not None:
        acc, elig = r.slot_counts()
        rec.update(tau=r.tau, steps=r.steps, target_forwards=r.target_forwards, accepted=r.accepted,
                   accepted_per_slot=acc, eligible_per_slot=elig, draft_s=r.draft_s,
                   verify_s=r.verify_s, prefill_s=r.prefill_s, refeeds=r.refeeds)
        if r.scan_blocks:
            rec["scan_matched"] = r.scan_matched      # per teacher-forced block (eval --teacher-forced-every)
    return rec


def run_methods(methods, ids, block_size, max_new_tokens, eos) -> dict[str, SpecResult]:
    """{method: its speculative generation of `ids`} for (name, verifier, proposer) triples, in order."""
    return {name: speculative_generate(verifier, proposer, ids, block_size=block_size,
                                       max_new_tokens=max_new_tokens, eos_ids=eos)
            for name, verifier, proposer in methods}


def warm_up(greedy, ids, eos, methods, block_size) -> None:
    """A short generation of each kind, so one-time costs (CUDA context, kernel choice) stay out of the timings."""
    greedy(ids, WARMUP_TOKENS, eos)
    for _, verifier, proposer in methods:
        speculative_generate(verifier, proposer, ids, block_size=block_size, max_new_tokens=WARMUP_TOKENS,
                             eos_ids=eos)
