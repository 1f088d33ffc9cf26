"""`dflash-pipe eval`: real speculative decoding of target + exported drafter on prompt sets.

For every prompt of every set (cfg.eval.prompts; all of them unless cfg.eval.max_prompts; MT-Bench
with both turns unless cfg.eval.mtbench_turns = 1, turn 2 asked after the target's own first answer)
these generations of cfg.eval.max_new_tokens tokens run on the same target, one after the other, at
batch 1: target-only greedy (the reference output and the tokens/s baseline), DFlash with each
drafter, and the n-gram prompt-lookup baseline through the same verify/accept harness. A short
warm-up generation of each kind runs first so one-time costs (CUDA context, kernel selection) stay
out of the timings. A prompt (turn) longer than the context leaves room for is skipped, counted and
named in the report.

References (cfg.eval.reference; reference_batch.py): 'sequential' decodes each target-only reference
at batch 1 as above; 'batched' (the default on CUDA with the static engine) generates a whole set's
references first by continuous batching on the static-KV engine (turn by turn in waves), compares
every method with them, and decodes target-only at batch 1 only on every cfg.eval.baseline_every-th
generation: the speed-ups are measured on those generations, and the report says how many.

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
from ..dist import check_device
from ..drafter import DrafterModelConfig, load_exported_drafter
from ..errors import UsageError, ValidationError
from ..io_utils import atomic_write_json, atomic_write_text
from ..progress import progress_bar
from ..target import load_target
from ..target.kernels import eval_linear_attn_kernels
from ..target.loading import TargetBundle
from .generation import record as _record, run_methods as _run_methods, warm_up as _warm_up
from .ngram import NgramProposer
from .progress_log import EvalProgress, run_key
from .reference_batch import BatchedReferenceSet, ReferenceBatcher, reference_note, resolve_reference
from .report import EXACT_DTYPES, acceptance_markdown, markdown_table, method_summary, plot_acceptance, training_tau
from .run_context import run_context
from .specdecode import DFlashProposer, SpecResult, eos_token_ids, make_dflash_verifier, sync_fn
from .draft_graph import GraphedDFlashProposer
from .engine_step import EngineTarget, EngineVerifier, engine_greedy_generate, resolve_engine
from .target_step import CACHED_MODES, TargetVerifier, greedy_generate

log = logging.getLogger("dflash_pipe.eval")


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """eval's and regenerate's device; a value dist.check_device refuses is a UsageError naming `flag`."""
    check_device(name, flag)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template the prompt with the generation prompt; plain text if the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return [int(t) for t in enc["input_ids"]]
    return [int(t) for t in tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]]


def encode_prompts(tokenizer, conversations: list[list[dict[str, str]]],
                   failed: dict[int, str] | None = None) -> list[list[int] | None]:
    """`encode_prompt` of many prompts at once: the templates rendered as text, then one batched tokenizer call
    (the Rust tokenizer's parallel path; `apply_chat_template(tokenize=True)` tokenizes its text the same way,
    without special tokens). With `failed` (a dict), a conversation the chat template raises on gets None and
    `failed[i]` says why (e.g. a template without a system role, or one that needs alternating roles); without it
    the template's error propagates."""
    if not conversations:
        return []
    if not getattr(tokenizer, "chat_template", None):
        enc = tokenizer(["\n\n".join(m["content"] for m in msgs) for msgs in conversations])["input_ids"]
        return [[int(t) for t in ids] for ids in enc]
    texts: list[str | None] = []
    for i, m in enumerate(conversations):
        try:
            texts.append(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False))
        except Exception as exc:  # noqa: BLE001 - any template failure is this conversation's, reported by the caller
            if failed is None:
                raise
            failed[i] = f"the chat template failed: {type(exc).__name__}: {exc}"
            texts.append(None)
    ok = [t for t in texts if t is not None]
    enc = iter(tokenizer(ok, add_special_tokens=False)["input_ids"] if ok else [])
    return [None if t is None else [int(x) for x in next(enc)] for t in texts]


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
    if not raw or Path(raw).is_dir() or ("=" not in raw and "," not in raw):   # one directory ('runs/lr=3e-4/export')
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


def run_eval(cfg: RunConfig, *, bundle: TargetBundle | None = None) -> dict:
    """Run the eval described by cfg (module docstring); returns the report dict.

    bundle: an already loaded target to use instead of loading cfg.target (tests, notebooks).
    """
    ev = cfg.eval
    if ev.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {ev.max_new_tokens}")
    if ev.baseline_every < 1:
        raise UsageError(f"--baseline-every must be >= 1 (1 = time every generation), got {ev.baseline_every}")
    if ev.teacher_forced_every < 0:   # before minutes of loading; the upper bound (the block size) is checked later
        raise UsageError(f"--teacher-forced-every must be >= 0 (0 = off), got {ev.teacher_forced_every}")
    device = resolve_device(ev.device, "--device / [eval] device")
    specs = drafter_specs(cfg)
    out_dir = output_dir(cfg)
    t = cfg.target
    if bundle is None:
        bundle = load_target(t.model, device=device, dtype=t.dtype, revision=t.revision,
                             trust_remote_code=t.trust_remote_code, seed=t.seed, model_cache_dir=t.model_cache_dir,
                             attn_implementation=t.attn_implementation)
    device = bundle.device
    model, tok = bundle.model, bundle.tokenizer
    linear_kernels = eval_linear_attn_kernels(t.linear_attn_kernels, device, model)
    dcfgs, proposers = _load_drafters(specs, bundle, ev.draft_graphs)
    sets = load_prompt_sets(ev.prompts, ev.max_prompts, skip_samples=cfg.data.skip_samples,
                            source=cfg.data.source, format=cfg.data.format, mtbench_turns=ev.mtbench_turns)
    eos = eos_token_ids(model, tok)
    B = next(iter(dcfgs.values())).block_size
    max_pos = min(int(getattr(bundle.config, "max_position_embeddings", 1 << 30) or 1 << 30),
                  *(d.max_position_embeddings for d in dcfgs.values()))
    max_prompt = max_pos - ev.max_new_tokens - B
    verifiers, plain_verifier, greedy, engine_note = _targets(model, bundle, dcfgs, ev, device, max_pos, B)
    cache_mode = plain_verifier.mode
    reference = resolve_reference(ev.reference, model, "static" if cache_mode == "static" else "hf", device)
    batcher = ReferenceBatcher(model, eos, ev.max_new_tokens, max_pos) if reference == "batched" else None
    methods = [(m, verifiers[m], proposers[m]) for m in dcfgs] + [("ngram", plain_verifier, NgramProposer())]
    print(f"eval: target {bundle.identity.get('model', t.model)} ({bundle.family}, {bundle.identity['dtype']}) "
          f"on {device}, drafters " + ", ".join(f"{s.method} {s.export} (layers {dcfgs[s.method].target_layer_ids})"
                                                for s in specs) +
          f", B={B}, cache mode {cache_mode} ({engine_note}), {ev.max_new_tokens} new tokens, references "
          + (f"batched (batch-1 target-only on one generation in {ev.baseline_every})" if batcher else "sequential"),
          flush=True)
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
                    "device": str(device), "cache_mode": cache_mode, "target_forward": engine_note,
                    "linear_attn_kernels": linear_kernels,
                    "max_new_tokens": ev.max_new_tokens, "reference": reference,
                    "max_prompt_tokens": max_prompt, "mtbench_turns": ev.mtbench_turns, "eos_token_ids": eos,
                    "sets": {}}
    records: list[dict] = []
    if not 0 <= ev.teacher_forced_every <= B:
        raise UsageError(f"--teacher-forced-every must be in 0..{B} (the block size), got {ev.teacher_forced_every}")
    if ev.teacher_forced_every and not ev.replay:
        raise UsageError("--teacher-forced-every scans the reference with the replay's features", "add --replay")
    if ev.replay and batcher is None:
        raise UsageError("--replay walks the methods against batched references, but the references are "
                         f"'{reference}'", "add --reference batched (it needs the static-KV engine: --engine static)")
    progress = EvalProgress(out_dir, run_key([(s.method, s.export) for s in specs], bundle.identity,
                                             ev.max_new_tokens, B, f"{ev.prompts}|{cache_mode}"
                                             + (f"|batched:{ev.baseline_every}" if batcher else "")
                                             + ("|replay" if ev.replay else "")
                                             # (records with the scan's per-block list; older ones do not resume)
                                             + (f"|scan{ev.teacher_forced_every}" if ev.teacher_forced_every else "")))
    if progress.done:
        print(f"eval: resuming, {len(progress.done)} generations already done ({progress.path})", flush=True)
    run = _SetRun(greedy, tok, methods, B, ev.max_new_tokens, eos, max_prompt, progress, sync_fn(device),
                  batcher, ev.baseline_every, ev.replay, ev.teacher_forced_every)
    try:
        for set_name, prompts in sets.items():
            report["sets"][set_name] = run.run_set(set_name, prompts, records, cache_mode)
    finally:
        for verifier in verifiers.values():
            verifier.close()
        plain_verifier.close()
        if batcher is not None:
            batcher.close()
    report["training"] = {s.method: training_tau(s.train_dir) for s in specs}
    _write(report, records, out_dir, cfg)
    progress.finish()  # the report holds everything now; a later rerun measures afresh
    return report


class _SetRun(BatchedReferenceSet):
    """Decodes the generations of one prompt set: every turn of every prompt, each by every method.

    A prompt's later turns (MT-Bench turn 2) are asked after the target-only greedy answer to the
    earlier ones (the reference, which every method reproduces in fp32), so all methods decode the
    same turn-2 prompt. A generation's id is the prompt's id, "<id>/turn<k>" for turn k >= 2. A turn
    whose prompt is empty or longer than max_prompt tokens is skipped, counted and named, and so
    are the prompt's later turns (they would be conditioned on it). With a `batcher` (--reference
    batched) the references come from reference_batch.py first and batch-1 target-only runs on
    every `every`-th generation only.
    """

    def __init__(self, greedy, tok, methods, block_size, max_new_tokens, eos, max_prompt, progress, sync,
                 batcher: ReferenceBatcher | None = None, every: int = 8, replay: bool = False, scan_every: int = 0):
        self.greedy, self.tok, self.methods, self.B = greedy, tok, methods, block_size
        self.max_new, self.eos, self.max_prompt = max_new_tokens, eos, max_prompt
        self.progress, self.sync = progress, sync
        self.batcher, self.every, self.replay, self.scan_every = batcher, every, replay, scan_every
        self.warmed = False

    def run_set(self, set_name: str, prompts: list[Prompt], records: list[dict], cache_mode: str) -> dict:
        if self.batcher is not None:
            return self._run_batched(set_name, prompts, records, cache_mode)
        refs, ref_wall, res, skipped, kept = [], [], {m: [] for m, _, _ in self.methods}, [], 0
        bar = progress_bar(len(prompts), f"eval {set_name}", "prompt")
        for prompt in prompts:
            history = list(prompt.messages)
            for k, followup in enumerate([None, *prompt.followups]):
                gen_id = prompt.id if k == 0 else f"{prompt.id}/turn{k + 1}"
                if followup is not None:
                    history.append({"role": "user", "content": followup})
                ids = encode_prompt(self.tok, history)
                if not 0 < len(ids) <= self.max_prompt:
                    skipped.append({"id": gen_id, "prompt_tokens": len(ids)})
                    break
                kept += k == 0
                ref, wall, results = self._generation(set_name, gen_id, ids)
                refs.append(ref)
                ref_wall.append(wall)
                records.append(_record(set_name, gen_id, "target", None, ref, wall, ref))
                for name, r in results.items():
                    res[name].append(r)
                    records.append(_record(set_name, gen_id, name, r, r.tokens, r.wall_s, ref))
                bar.update(0, tokens=len(ref))
                history.append({"role": "assistant", "content": self.tok.decode(ref, skip_special_tokens=True)})
            bar.update(1)
        bar.close()
        self._warn_skipped(set_name, skipped)
        summary = _set_summary(refs, ref_wall, res, len(skipped), cache_mode)
        summary.update(prompts=kept, generations=len(refs), skipped_ids=skipped)
        return summary

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_prompt(self.tok, messages)

    def _warn_skipped(self, set_name: str, skipped: list[dict]) -> None:
        if skipped:
            log.warning("%s: skipped %d generations whose prompt is empty or longer than %d tokens: %s", set_name,
                        len(skipped), self.max_prompt, ", ".join(s["id"] for s in skipped))

    def _generation(self, set_name: str, gen_id: str, ids: list[int]):
        done = self.progress.get(set_name, gen_id, ids)
        if done is not None:
            return done
        if not self.warmed:
            _warm_up(self.greedy, ids, self.eos, self.methods, self.B)
            self.warmed = True
        ref, wall, results = _decode_prompt(self.greedy, ids, self.methods, self.B, self.max_new, self.eos, self.sync)
        self.progress.add(set_name, gen_id, ids, ref, wall, results)
        return ref, wall, results


def _load_drafters(specs: list[DrafterSpec], bundle: TargetBundle, draft_graphs: str = "auto"):
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
        args = (drafter, dcfg, bundle.model.get_input_embeddings().weight, bundle.model.get_output_embeddings())
        graphed = draft_graphs == "on" or (draft_graphs == "auto" and bundle.device.type == "cuda")
        proposers[spec.method] = (GraphedDFlashProposer(*args, use_graphs=draft_graphs) if graphed
                                  else DFlashProposer(*args))
    return dcfgs, proposers


def _targets(model, bundle: TargetBundle, dcfgs: dict, ev, device, max_pos: int, B: int):
    """(verifier per drafter, the n-gram verifier, greedy(ids, n, eos), a note): on the static-KV engine
    (engine_step.py) or on the model's HF cache (target_step.py), as --engine and --cache-mode choose."""
    engine = ev.engine
    if ev.cache_mode not in ("auto", "crop"):
        if engine == "static":
            raise UsageError(f"--engine static verifies with a static KV cache, not cache mode {ev.cache_mode!r}",
                             "use --cache-mode auto (or crop), or --engine hf")
        engine = "hf"
    kind, note = resolve_engine(model, engine, device)
    if kind == "static":
        union = sorted(set().union(*(d.target_layer_ids for d in dcfgs.values())))
        target = EngineTarget(model, union, max_len=min(max_pos, 2048), limit=max_pos, block_size=B)
        verifiers = {m: EngineVerifier(target, d.target_layer_ids, B) for m, d in dcfgs.items()}
        return (verifiers, EngineVerifier(target, (), B),
                lambda ids, n, eos: engine_greedy_generate(target, ids, n, eos), note)
    verifiers = {m: make_dflash_verifier(model, d, bundle.num_layers, bundle.hidden_size, ev.cache_mode,
                                         ev.rollback_refeed)
                 for m, d in dcfgs.items()}
    return (verifiers, TargetVerifier(model, cache_mode=ev.cache_mode, refeed=ev.rollback_refeed),
            lambda ids, n, eos: greedy_generate(model, ids, n, eos), f"HF forward and cache ({note})")


def _decode_prompt(greedy, ids, methods, block_size, max_new_tokens, eos, sync):
    """Target-only greedy (reference tokens, wall s), then every method's speculative generation."""
    t0 = time.perf_counter()
    ref = greedy(ids, max_new_tokens, eos)
    sync()
    wall = time.perf_counter() - t0
    return ref, wall, _run_methods(methods, ids, block_size, max_new_tokens, eos)


def _set_summary(refs, ref_wall, results: dict[str, list[SpecResult]], skipped: int, cache_mode: str) -> dict:
    target_tokens, target_wall = sum(len(r) for r in refs), sum(ref_wall)
    target_tok_s = target_tokens / target_wall if target_wall > 0 else None
    return {"prompts": len(refs), "skipped_too_long": skipped,
            "target_only": {"generated_tokens": target_tokens, "wall_s": target_wall, "tokens_per_s": target_tok_s},
            **{m: method_summary(rs, refs, target_tok_s, cache_mode in CACHED_MODES + ("static",))
               for m, rs in results.items()}}


def _write(report: dict, records: list[dict], out_dir: Path, cfg: RunConfig) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "eval_report.json", report)
    note = reference_note(report)
    table = markdown_table(report) + (f"\n{note}\n" if note else "")
    atomic_write_text(out_dir / "eval_report.md", "# DFlash acceptance eval\n\n" + table + acceptance_markdown(report)
                      + "\n" + run_context(report))
    atomic_write_text(out_dir / "eval_prompts.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    if report["sets"]:
        plot_acceptance(report, out_dir / "acceptance.png")
    write_resolved(cfg, out_dir)
    print(table, end="", flush=True)
    print("\n" + run_context(report), end="", flush=True)
    print(f"eval: report in {out_dir}", flush=True)

