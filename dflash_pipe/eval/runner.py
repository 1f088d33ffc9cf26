"""`dflash-pipe eval`: real speculative decoding of target + exported drafter on prompt sets.

For every prompt of every set (cfg.eval.prompts, at most cfg.eval.max_prompts each) these
generations of cfg.eval.max_new_tokens tokens run on the same target, one after the other:
target-only greedy (the reference output and the tokens/s baseline), DFlash with each drafter, and
the n-gram prompt-lookup baseline through the same verify/accept harness. A short warm-up
generation of each kind runs first so one-time costs (CUDA context, kernel selection) stay out of
the timings.

Drafters (cfg.eval.drafter): one export directory (default <train.output_dir>/export), reported as
method "dflash" with the training tau of <train.output_dir>; or a comma list "name=dir,..."
reported as "dflash:<name>" each, with the training tau of the export's parent directory (where
`dflash-pipe train` writes metrics.jsonl). Several drafters on one run share the target-only and
n-gram generations, so their comparison is paired: the same prompts, references and baseline.

Outputs (cfg.eval.output_dir, default <train.output_dir>/eval): eval_report.json,
eval_report.md, acceptance.png, eval_prompts.jsonl (one line per prompt and method) and
resolved_config.toml. The Markdown table is also printed, with the training-time simulated tau
from <train.output_dir>/metrics.jsonl when that file exists. An interrupted eval resumes: finished
prompts are kept in eval_progress.jsonl until the report is written (progress_log.py).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RunConfig, write_resolved
from ..data.prompts import Prompt, load_prompt_sets
from ..drafter import DrafterModelConfig, load_exported_drafter
from ..errors import UsageError, ValidationError
from ..io_utils import atomic_write_json, atomic_write_text
from ..progress import progress_bar
from ..target import load_target
from ..target.loading import TargetBundle
from .ngram import NgramProposer
from .progress_log import EvalProgress, run_key
from .report import EXACT_DTYPES, acceptance_markdown, markdown_table, method_summary, plot_acceptance, training_tau
from .run_context import run_context
from .specdecode import (DFlashProposer, SpecResult, eos_token_ids, make_dflash_verifier, speculative_generate,
                         sync_fn)
from .target_step import TargetVerifier, greedy_generate

log = logging.getLogger("dflash_pipe.eval")
WARMUP_TOKENS = 8


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device '{name}' was asked for, but no CUDA GPU is visible", "pass --device cpu")
    return device


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template the prompt with the generation prompt; plain text if the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return [int(t) for t in enc["input_ids"]]
    return [int(t) for t in tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]]


def check_drafter_fits(dcfg: DrafterModelConfig, bundle: TargetBundle, where: str) -> None:
    """Refuse a drafter trained for another target, naming every field that differs."""
    expect = {"hidden_size": bundle.hidden_size, "num_target_layers": bundle.num_layers,
              "vocab_size": bundle.vocab_size}
    diff = {k: (getattr(dcfg, k), v) for k, v in expect.items() if getattr(dcfg, k) != v}
    if diff:
        lines = "; ".join(f"{k}: drafter {a} vs target {b}" for k, (a, b) in diff.items())
        raise ValidationError(f"{where} was not trained for this target: {lines}",
                              "pass the target the drafter was trained on (--target-model), or another --drafter")


@dataclass
class DrafterSpec:
    method: str       # report key: "dflash" or "dflash:<name>"
    export: Path      # exported drafter directory
    train_dir: Path   # where its training wrote metrics.jsonl (for the simulated tau beside the eval's)


_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")


def drafter_specs(cfg: RunConfig) -> list[DrafterSpec]:
    """The drafters --drafter names (module docstring), each checked to exist."""
    raw = cfg.eval.drafter.strip()
    if "=" not in raw and "," not in raw:
        d = Path(raw) if raw else Path(cfg.train.output_dir) / "export"
        specs = [DrafterSpec("dflash", d, Path(cfg.train.output_dir))]
    else:
        specs = []
        for item in (x.strip() for x in raw.split(",")):
            name, sep, path = (p.strip() for p in item.partition("="))
            if not sep or not _NAME_OK.match(name) or not path:
                raise UsageError(f"--drafter entry {item!r} is not name=dir (name of letters, digits, '_', '.', '-')",
                                 "write e.g. --drafter lossless=runs/a/export,fp8=runs/b/export")
            if any(s.method == f"dflash:{name}" for s in specs):
                raise UsageError(f"--drafter names {name!r} twice", "give every drafter its own name")
            specs.append(DrafterSpec(f"dflash:{name}", Path(path), Path(path).parent))
    for spec in specs:
        if not spec.export.is_dir():
            raise UsageError(f"drafter export {spec.export} does not exist",
                             "train first (`dflash-pipe train` writes <output_dir>/export) or pass --drafter DIR")
    return specs


def output_dir(cfg: RunConfig) -> Path:
    return Path(cfg.eval.output_dir) if cfg.eval.output_dir else Path(cfg.train.output_dir) / "eval"


def _record(set_name: str, prompt: Prompt, method: str, r: SpecResult | None, tokens: list[int],
            wall_s: float, reference: list[int]) -> dict:
    rec = {"set": set_name, "id": prompt.id, "method": method, "generated": len(tokens), "wall_s": wall_s,
           "identical_to_target": tokens == reference}
    if r is not None:
        acc, elig = r.slot_counts()
        rec.update(tau=r.tau, steps=r.steps, target_forwards=r.target_forwards, accepted=r.accepted,
                   accepted_per_slot=acc, eligible_per_slot=elig, draft_s=r.draft_s)
    return rec


def run_eval(cfg: RunConfig, *, bundle: TargetBundle | None = None) -> dict:
    """Run the eval described by cfg (module docstring); returns the report dict.

    bundle: an already loaded target to use instead of loading cfg.target (tests, notebooks).
    """
    ev = cfg.eval
    if ev.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {ev.max_new_tokens}")
    device = resolve_device(ev.device)
    specs = drafter_specs(cfg)
    out_dir = output_dir(cfg)
    t = cfg.target
    if bundle is None:
        bundle = load_target(t.model, device=device, dtype=t.dtype, revision=t.revision,
                             trust_remote_code=t.trust_remote_code, seed=t.seed, model_cache_dir=t.model_cache_dir,
                             attn_implementation=t.attn_implementation)
    device = bundle.device
    model, tok = bundle.model, bundle.tokenizer
    dcfgs, proposers = _load_drafters(specs, bundle)
    sets = load_prompt_sets(ev.prompts, ev.max_prompts, skip_samples=cfg.data.skip_samples,
                            source=cfg.data.source, format=cfg.data.format)
    eos = eos_token_ids(model, tok)
    B = next(iter(dcfgs.values())).block_size
    max_pos = min(int(getattr(bundle.config, "max_position_embeddings", 1 << 30) or 1 << 30),
                  *(d.max_position_embeddings for d in dcfgs.values()))
    max_prompt = max_pos - ev.max_new_tokens - B
    verifiers = {m: make_dflash_verifier(model, d, bundle.num_layers, bundle.hidden_size) for m, d in dcfgs.items()}
    plain_verifier = TargetVerifier(model)
    cache_mode = plain_verifier.mode
    methods = [(m, verifiers[m], proposers[m]) for m in dcfgs] + [("ngram", plain_verifier, NgramProposer())]
    print(f"eval: target {bundle.identity.get('model', t.model)} ({bundle.family}, {bundle.identity['dtype']}) "
          f"on {device}, drafters " + ", ".join(f"{s.method} {s.export} (layers {dcfgs[s.method].target_layer_ids})"
                                                for s in specs) +
          f", B={B}, cache mode {cache_mode}, {ev.max_new_tokens} new tokens", flush=True)
    if bundle.identity["dtype"] not in EXACT_DTYPES:
        print(f"eval: note: in {bundle.identity['dtype']} the outputs can drift from target-only greedy decoding "
              f"after a near-tie (the report counts identical outputs); --target-dtype float32 makes them exact",
              flush=True)
    report: dict = {"target": {k: bundle.identity.get(k) for k in ("model", "model_type", "weights_fingerprint",
                                                                   "dtype", "num_layers")},
                    "drafters": {s.method: {"dir": str(s.export), "block_size": B,
                                            "num_layers": dcfgs[s.method].num_layers,
                                            "target_layer_ids": dcfgs[s.method].target_layer_ids,
                                            "mask_token_id": dcfgs[s.method].mask_token_id} for s in specs},
                    "device": str(device), "cache_mode": cache_mode, "max_new_tokens": ev.max_new_tokens,
                    "eos_token_ids": eos, "sets": {}}
    records: list[dict] = []
    warmed = False
    sync = sync_fn(device)
    progress = EvalProgress(out_dir, run_key([(s.method, s.export) for s in specs], bundle.identity,
                                             ev.max_new_tokens, B, ev.prompts))
    if progress.done:
        print(f"eval: resuming, {len(progress.done)} prompts already done ({progress.path})", flush=True)
    try:
        for set_name, prompts in sets.items():
            encoded = [(p, encode_prompt(tok, p.messages)) for p in prompts]
            kept = [(p, ids) for p, ids in encoded if 0 < len(ids) <= max_prompt]
            if len(kept) < len(encoded):
                log.warning("%s: skipped %d prompts longer than %d tokens", set_name, len(encoded) - len(kept),
                            max_prompt)
            if not warmed and any(progress.get(set_name, p.id) is None for p, _ in kept):
                _warm_up(model, kept[0][1], eos, methods, B)
                warmed = True
            refs, ref_wall, res = [], [], {m: [] for m, _, _ in methods}
            bar = progress_bar(len(kept), f"eval {set_name}", "prompt")
            for prompt, ids in kept:
                done = progress.get(set_name, prompt.id)
                if done is not None:
                    ref, wall, results = done
                else:
                    ref, wall, results = _decode_prompt(model, ids, methods, B, ev.max_new_tokens, eos, sync)
                    progress.add(set_name, prompt.id, ref, wall, results)
                refs.append(ref)
                ref_wall.append(wall)
                records.append(_record(set_name, prompt, "target", None, ref, wall, ref))
                for name, r in results.items():
                    res[name].append(r)
                    records.append(_record(set_name, prompt, name, r, r.tokens, r.wall_s, ref))
                bar.update(1, tokens=len(ref))
            bar.close()
            report["sets"][set_name] = _set_summary(refs, ref_wall, res, len(encoded) - len(kept), cache_mode)
    finally:
        for verifier in verifiers.values():
            verifier.close()
        plain_verifier.close()
    report["training"] = {s.method: training_tau(s.train_dir) for s in specs}
    _write(report, records, out_dir, cfg)
    progress.finish()  # the report holds everything now; a later rerun measures afresh
    return report


def _load_drafters(specs: list[DrafterSpec], bundle: TargetBundle):
    """(method -> drafter config, method -> proposer), every drafter checked against the target; all of
    one block size (the n-gram baseline drafts blocks of that size too)."""
    dcfgs, proposers = {}, {}
    for spec in specs:
        drafter, dcfg = load_exported_drafter(spec.export, dtype=bundle.dtype, device=bundle.device, attention="sdpa")
        check_drafter_fits(dcfg, bundle, f"drafter {spec.export}")
        first = next(iter(dcfgs.values()), None)
        if first is not None and dcfg.block_size != first.block_size:
            raise ValidationError(f"drafter {spec.export} has block size {dcfg.block_size}, {specs[0].export} has "
                                  f"{first.block_size}", "compare drafters of one block size in one eval")
        dcfgs[spec.method] = dcfg
        proposers[spec.method] = DFlashProposer(drafter, dcfg, bundle.model.get_input_embeddings().weight,
                                                bundle.model.get_output_embeddings())
    return dcfgs, proposers


def _decode_prompt(model, ids, methods, block_size, max_new_tokens, eos, sync):
    """Target-only greedy (reference tokens, wall s), then every method's speculative generation."""
    t0 = time.perf_counter()
    ref = greedy_generate(model, ids, max_new_tokens, eos)
    sync()
    wall = time.perf_counter() - t0
    results = {name: speculative_generate(verifier, proposer, ids, block_size=block_size,
                                          max_new_tokens=max_new_tokens, eos_ids=eos)
               for name, verifier, proposer in methods}
    return ref, wall, results


def _set_summary(refs, ref_wall, results: dict[str, list[SpecResult]], skipped: int, cache_mode: str) -> dict:
    target_tokens, target_wall = sum(len(r) for r in refs), sum(ref_wall)
    target_tok_s = target_tokens / target_wall if target_wall > 0 else None
    return {"prompts": len(refs), "skipped_too_long": skipped,
            "target_only": {"generated_tokens": target_tokens, "wall_s": target_wall, "tokens_per_s": target_tok_s},
            **{m: method_summary(rs, refs, target_tok_s, cache_mode == "crop") for m, rs in results.items()}}


def _warm_up(model, ids, eos, methods, block_size) -> None:
    greedy_generate(model, ids, WARMUP_TOKENS, eos)
    for _, verifier, proposer in methods:
        speculative_generate(verifier, proposer, ids, block_size=block_size, max_new_tokens=WARMUP_TOKENS,
                             eos_ids=eos)


def _write(report: dict, records: list[dict], out_dir: Path, cfg: RunConfig) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "eval_report.json", report)
    table = markdown_table(report)
    atomic_write_text(out_dir / "eval_report.md", "# DFlash acceptance eval\n\n" + table + acceptance_markdown(report)
                      + "\n" + run_context(report))
    atomic_write_text(out_dir / "eval_prompts.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    if report["sets"]:
        plot_acceptance(report, out_dir / "acceptance.png")
    write_resolved(cfg, out_dir)
    print(table, end="", flush=True)
    print("\n" + run_context(report), end="", flush=True)
    print(f"eval: report in {out_dir}", flush=True)

