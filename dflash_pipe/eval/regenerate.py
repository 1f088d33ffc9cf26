"""`dflash-pipe regenerate`: rewrite the assistant turns of a dataset with the target's own answers.

A drafter learns to predict what the *target* generates, so training on the target's own
responses (rather than on another model's ShareGPT answers) raises acceptance. This command
reads conversations with `dflash_pipe.data` (cfg.data source / format / skip / max / strict) and
writes OpenAI-format JSONL rows ``{"id", "messages"}`` that `extract` reads back.

Multi-turn, turn by turn: each assistant turn is replaced by the target's response to the
conversation so far, where earlier assistant turns are already the regenerated ones and user /
system turns are kept verbatim. Details:
  * assistant turns before the first user turn are dropped (they answer nothing), and so is a
    trailing user turn after the last answer (nothing to train on);
  * a conversation stops (keeping the turns done so far) when the next prompt plus
    max_new_tokens would exceed cfg.extract.max_length tokens, which extraction would cut
    anyway, when the target answers with nothing, or when the chat template raises on the prompt
    (e.g. a system turn a template does not support); if that happens at the first turn the
    conversation is skipped (recorded in the sidecar with its reason, so a rerun does not retry
    it; `prompts_too_long` / `empty_answers` / `template_errors` count the events);
  * a response that reaches max_new_tokens without an end-of-turn token is kept as it is
    (counted as truncated in the sidecar).
Decoding is greedy by default; ``--temperature T --top-p P --seed S`` samples instead, and
``--samples N`` writes N answers per conversation with ids ``<id>#0 .. <id>#N-1`` (N = 1 keeps
the id); a sample equal to an earlier one of its conversation is written but counted
(``duplicate_rows`` / ``duplicate_tokens`` in the sidecar). ``--first-sample K`` numbers them from K
instead (ids ``<id>#K ..``): a second file with more answers per prompt whose rows equal what a run
with K + N samples would write for those ids, since an answer depends on its id, not on the run; an
output file stays in input order, so more samples cannot be appended to a finished one
(bench/quality_gpu.sh's regen-more job adds them in a second file beside the first). ``--greedy-after K`` samples only the
first K tokens of each answer and continues greedily. A sampled answer is a function of (seed,
sample id, turn) and the target only (regen_sampling): not of the batch size or of which
conversations share a batch.

How (regen_backends): on attention-only targets a static-KV engine runs `batch_size` slots of
continuous batching (finished slots refilled with the next prompts, CUDA graphs on CUDA); other
targets (hybrid / recurrent layers) fall back to HF `generate`, greedy, named in the log. Up to
IN_FLIGHT x batch_size conversations are in flight (8: fewer stalled `--lookup-draft` runs, whose fast answers
pile up behind the oldest unfinished one); their ready turns are served oldest conversation
first, and the answers are written in input order. While the device runs a launch, the host
detokenizes the answers just collected and tokenizes the round's new prompts in one batched call
(`encode_prompts`; a conversation's first prompt is tokenized ahead on a worker thread, regen_turns.py); the
time of each phase is logged at the end and kept in the sidecar's "timing" (updated at every flush, so a run
stopped by a deadline keeps its split up to its last flush).

Prefix-stable, resumable and crash-safe: rows are appended in input order only (a finished
conversation waits for the earlier ones), so a file made with max_samples = N is the prefix of
one made with more. Each flush writes its rows with one write, then flush + fsync, and only then
is the progress sidecar ``<output>.progress.json`` (written atomically) updated. A rerun with the
same settings skips every id already in the output (and the recorded skipped ids); a partially
written last line (a killed writer) is detected and cut off first. The sidecar also pins the
settings (target weights, data selection, max_new_tokens, max_length, decoding): resuming with
different ones is refused instead of mixing two datasets in one file. Out of GPU memory, the
batch is halved (logged) and the answers in flight are rerun; they come out the same.

Time caps: a kill loses the conversations in flight (up to 8 x batch_size, and every finished one
behind the oldest unfinished, since rows go out in input order). ``--max-seconds S`` stops
admitting conversations S seconds after the command started and finishes the ones in flight, so
the output is a prefix of the input with nothing generated in vain; the sidecar records
``stopped_early`` and a rerun continues after it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from ..config import RunConfig
from ..data import DataStats, load_conversations
from ..errors import RuntimeFailure, UsageError
from ..io_utils import atomic_write_json
from ..progress import progress_bar
from ..target import load_target
from .regen_backend_choice import ENGINE_ATTENTION, ENGINES, halve_batch, make_backend  # noqa: F401 - re-exported
from .regen_backends import Completion, TurnRequest
from .regen_lookup import check_lookup
from .regen_output import JsonlAppender, load_sidecar, scan_output, settings_of, sidecar_path  # noqa: F401
from .regen_sampling import Decoding
from .regen_turns import COUNTERS, ConvState, PromptReadAhead, Regenerator
from .runner import resolve_device
from .specdecode import eos_token_ids

log = logging.getLogger("dflash_pipe.eval")
FLUSH_SECONDS = 10.0
IN_FLIGHT = 8                # conversations in flight per slot (module docstring)
_now = time.monotonic        # the --max-seconds clock (a seam for tests)
def _queue(ready: list[TurnRequest], req: TurnRequest | None) -> None:
    if req is not None:
        bisect.insort(ready, req, key=lambda r: r.order)


def _timing(split: dict, backend, wall: float) -> dict:
    """Where the run's wall time went: set-up before the loop (setup_s, not in wall_s), host phases of the driver
    loop, plus the backend's own counters."""
    out = {"wall_s": round(wall, 3), **{k: round(v, 3) for k, v in split.items()}}
    out.update(backend.stats() if hasattr(backend, "stats") else {"decode_steps": backend.decode_steps})
    return out


# --------------------------------------------------------------------------- command

def length_limit(max_length: int, bundle) -> tuple[int, str]:
    """The tokens a conversation may reach (prompt + answer), and its name for the skip reasons: [extract]
    max_length, or the model's context (max_position_embeddings) where that is shorter."""
    context = getattr(getattr(bundle, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and 0 < context < max_length:
        print(f"regenerate: the target's context is {context} tokens, under [extract] max_length {max_length}: "
              f"conversations stop (or are skipped) at {context}", flush=True)
        return context, f"the model's context of {context} tokens"
    return max_length, f"max_length {max_length}"


def _validate(cfg: RunConfig, max_new_tokens: int, batch_size: int, dec: Decoding) -> None:
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 0:
        raise UsageError(f"--batch-size must be >= 1 (or 0 = auto), got {batch_size}")
    if cfg.extract.max_length <= max_new_tokens:
        raise UsageError(f"[extract] max_length ({cfg.extract.max_length}) must exceed --max-new-tokens "
                         f"({max_new_tokens})")
    dec.validate()


def run_regenerate(cfg: RunConfig, output: Path, max_new_tokens: int = 512, batch_size: int = 0,
                   device: str = "auto", *, bundle=None, max_turns: int = 0, samples: int = 1,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, engine: str = "auto",
                   attention: str = "auto", greedy_after: int = 0, reuse_history: bool = False, overlap: bool = False,
                   compact: bool = False, max_seconds: float = 0.0, first_sample: int = 0,
                   prefetch_prompts: bool = True, prefill_layout: str = "auto", collect_early: int | None = None,
                   steps_per_launch: int = 8, lookup_draft: int | None = None,
                   lookup_shared: bool = True) -> dict:
    """Regenerate cfg.data's conversations into `output` (JSONL); returns the final sidecar dict.

    batch_size 0 = auto (16 on the CPU, up to 1024 on CUDA as memory allows).
    bundle: an already loaded TargetBundle to use instead of loading cfg.target (tests, notebooks).
    reuse_history: later turns prefill only their new tokens into the row that generated the previous answer
    (engine backend; pointless with one turn: max_turns 1 turns it off).
    overlap: prefill waiting prompts on a second CUDA stream under the decode and collect answers a few steps
    before a launch's end (engine backend, regen_staging.py); the same output.
    compact: tail compaction (engine backend): once no prompt waits, live rows move to the lowest slots and the
    steps run on the first batch/2, /4 or /8 rows; refused with reuse_history. The same output.
    max_seconds: stop admitting conversations this long after the call (0 = no limit) and finish the ones in
    flight; the sidecar then says ``stopped_early``.
    first_sample: the first sample index (ids <id>#first_sample ..): more answers per prompt in another file.
    prefetch_prompts: read conversations ahead and tokenize their first prompts on a worker thread
    (regen_turns.PromptReadAhead); the same output.
    prefill_layout: how the engine prefills new prompts: "chunks" (16-token chunks, no padding to the longest
    prompt: target/chunked_prefill.py), "padded" (one padded call per length bucket), "auto" (chunks where the
    per-row attention kernel runs: CUDA, bf16 / fp16). The same answers up to rounding.
    steps_per_launch: decode steps queued per launch (engine backend): the host reads finished answers and
    refills their slots once per launch.
    collect_early: read the finished answers from a copy of the state taken this many steps before a launch's
    end, so the host's work between launches overlaps the last steps (None: 1 on CUDA, 0 on the CPU; up to
    steps_per_launch: the copy as the launch starts, the host a whole launch ahead). The same output; an answer
    that ends in those last steps waits one launch more.
    lookup_draft: K > 0 drafts K tokens a row from its own prompt and answer so far and verifies them in each
    decode step (engine backend, eval/regen_lookup.py; not with overlap or compact); 0 = off; None = auto (2 for
    greedy answers on CUDA graphs, else off). The same output up to the rounding of a (K + 1)-token forward.
    lookup_shared: the drafts may also come from an n-gram table all rows share (eval/regen_ngram_table.py),
    where it holds a longer match than the row's own history; False = the row's own history only.
    """
    started = _now() if max_seconds else 0.0
    entered = time.perf_counter()            # the set-up before the loop (target load, engine) is timed too
    output = Path(output)
    dec = Decoding(samples, temperature, top_p, seed, greedy_after, first_sample)
    _validate(cfg, max_new_tokens, batch_size, dec)
    check_lookup(lookup_draft, overlap, compact)                  # before the sidecar is written
    if max_seconds < 0:
        raise UsageError(f"--max-seconds must be >= 0 (0 = no limit), got {max_seconds}")
    if max_turns < 0:
        raise UsageError(f"--max-turns must be >= 0 (0 = every turn), got {max_turns}")
    if compact and reuse_history and max_turns != 1:
        raise UsageError("--compact-tail moves rows, --reuse-history keeps a finished answer's row in place for its "
                         "next turn: use one of them")
    if bundle is None:
        t = cfg.target
        bundle = load_target(t.model, device=resolve_device(device), dtype=t.dtype, revision=t.revision,
                             trust_remote_code=t.trust_remote_code, seed=t.seed, model_cache_dir=t.model_cache_dir,
                             attn_implementation=t.attn_implementation)
    eos = eos_token_ids(bundle.model, bundle.tokenizer)
    if not eos:
        raise UsageError("the target defines no EOS token; regenerated answers would never end",
                         "use a model whose tokenizer or generation config names an eos_token_id")
    pad = getattr(bundle.tokenizer, "pad_token_id", None)
    pad = int(pad) if isinstance(pad, int) else eos[0]
    state = load_sidecar(output, settings_of(cfg, bundle, max_new_tokens, max_turns, dec.settings()))
    state.pop("stopped_early", None)         # this run's own stop, if any, is recorded below
    done = scan_output(output)
    if len(done) > state["rows_written"]:   # a crash between a flush's rows and its sidecar: the rows stay (the
        # output is the truth) but their counters (tokens, truncations, ...) were never added; say how many
        state["rows_uncounted"] = int(state.get("rows_uncounted", 0)) + len(done) - state["rows_written"]
        print(f"regenerate: {len(done) - state['rows_written']} rows of {output} were written after the sidecar's "
              f"last update (a crash): they are kept, the counters leave them out (rows_uncounted)", flush=True)
    state["rows_written"] = len(done)
    skip = done | set(state["skipped"])
    atomic_write_json(sidecar_path(output), state)
    max_len, limit = length_limit(cfg.extract.max_length, bundle)
    regen = Regenerator(bundle.tokenizer, eos, max_new_tokens, max_len, max_turns, dec, limit)
    reuse_history = reuse_history and max_turns != 1
    tuning = dict(collect_early=collect_early, steps_per_launch=steps_per_launch, lookup_draft=lookup_draft,
                  lookup_shared=lookup_shared)
    backend = make_backend(bundle, eos, pad, batch_size, max_len, max_new_tokens, dec, engine,
                           attention, reuse_history, overlap, compact, prefill_layout, **tuning)
    print(f"regenerate: decode path: {backend.describe}", flush=True)
    state["decode_path"] = backend.describe          # informational (not a pinned setting)
    stats = DataStats()
    d = cfg.data
    convs = iter(load_conversations(d.source, d.format, d.strict, stats, d.skip_samples, d.max_samples))

    def samples_to_write(conv) -> list[str]:
        """The conversation's sample ids neither written nor skipped yet (none for a plain-text row)."""
        return [] if conv.is_text else [sid for sid in dec.sample_ids(conv.sample_id) if sid not in skip]

    prompts = PromptReadAhead(convs, bundle.tokenizer, chunk=max(64, backend.B // 4), enabled=prefetch_prompts,
                              wanted=lambda c: bool(samples_to_write(c)))
    bar = progress_bar(d.max_samples * dec.samples or None, "regenerate", "conv")
    if done:
        print(f"regenerate: resuming {output}: {len(done)} conversations already written", flush=True)
    writer = JsonlAppender(output)
    t0, seconds0 = time.perf_counter(), float(state["seconds"])
    split = {"setup_s": t0 - entered}
    inflight: list[ConvState] = []          # admitted, not yet written, in input order
    ready: list[TurnRequest] = []
    pending_rows: list[ConvState] = []
    order, exhausted, last_flush = 0, False, time.perf_counter()

    siblings = {"base": None, "seen": set()}   # the current conversation's samples written so far (content hashes)

    def count_duplicates(st: ConvState) -> None:
        """A sample whose whole conversation equals an earlier sample's is still written (the held-out head is
        counted in rows) but counted, so reports can give unique tokens. Samples of one conversation are
        adjacent in the output; after a resume the first conversation's earlier samples are not compared."""
        base = st.sample_id.rsplit("#", 1)[0]
        if base != siblings["base"]:
            siblings["base"], siblings["seen"] = base, set()
        key = hashlib.sha1(json.dumps(st.out, ensure_ascii=False).encode()).hexdigest()
        if key in siblings["seen"]:
            state["duplicate_rows"] = int(state.get("duplicate_rows", 0)) + 1
            state["duplicate_tokens"] = int(state.get("duplicate_tokens", 0)) + st.counts["generated_tokens"]
        siblings["seen"].add(key)

    def flush() -> None:
        nonlocal last_flush
        rows = [{"id": st.sample_id, "messages": st.out} for st in pending_rows if not st.skipped]
        if dec.samples > 1:
            for st in pending_rows:
                if not st.skipped:
                    count_duplicates(st)
        writer.append(rows)
        state["rows_written"] += len(rows)
        state["skipped"].update({st.sample_id: st.skipped for st in pending_rows if st.skipped})
        tokens = sum(st.counts["generated_tokens"] for st in pending_rows)
        for k in COUNTERS:
            state[k] = int(state.get(k, 0)) + sum(st.counts[k] for st in pending_rows)
        state["seconds"] = seconds0 + time.perf_counter() - t0
        state["data_stats"] = stats.to_dict()
        # this run's time split so far (one device sync per flush): an interrupted run keeps it too
        state["timing"] = _timing(split, backend, time.perf_counter() - t0)
        atomic_write_json(sidecar_path(output), state)
        bar.update(len(pending_rows), tokens=tokens)
        pending_rows.clear()
        last_flush = time.perf_counter()

    try:
        completions: list[Completion] = []
        split.update(dict.fromkeys(("launch_s", "detokenize_s", "tokenize_s", "write_s", "collect_s"), 0.0))
        cap = None                           # conversations admitted per round: all at first, then a trickle
        while True:
            launched = oom = False
            t_a = time.perf_counter()
            if ready or backend.busy():
                try:
                    backend.launch(ready)
                    launched = True
                except torch.OutOfMemoryError:
                    oom = True               # handled below, once the traceback no longer holds the engine
            t_b = time.perf_counter()
            split["launch_s"] += t_b - t_a
            if oom:
                # an OOM inside a prefill leaves the requests it had already placed in slots in `ready` too (the
                # backend trims `ready` after its calls): each goes back once
                queued = {id(r) for r in ready}
                for req in backend.take_back():
                    if id(req) not in queued:
                        _queue(ready, req)
                smaller = backend.B
                backend = None               # free its cache before allocating the smaller one
                backend = make_backend(bundle, eos, pad, halve_batch(smaller), max_len, max_new_tokens, dec, engine,
                                       attention, reuse_history, overlap, compact, prefill_layout, **tuning)
                state["decode_path"] = backend.describe
            # host work while the device decodes: the last answers, the next turns, new prompts, the output
            going = regen.record_all(completions)                                             # detokenizes
            t_c = time.perf_counter()
            split["detokenize_s"] += t_c - t_b
            for req in regen.next_requests(going):
                _queue(ready, req)
            admitted, fresh = 0, []
            # per round: all slots' worth at first, then B/16 plus as many as just finished (a trickle that keeps up)
            cap = backend.B if cap is None else max(16, backend.B // 16 + len(completions))
            if max_seconds and not exhausted and _now() - started >= max_seconds:
                exhausted = True             # no new conversations; the ones in flight finish and are written
                state["stopped_early"] = {"max_seconds": max_seconds, "in_flight": len(inflight)}
                print(f"regenerate: --max-seconds {max_seconds:g} reached: finishing the {len(inflight)} "
                      f"conversations in flight", flush=True)
            if not exhausted and len(ready) < backend.B and len(inflight) >= IN_FLIGHT * backend.B:
                split["in_flight_full_rounds"] = split.get("in_flight_full_rounds", 0) + 1
            while (not exhausted and admitted < cap and len(ready) < backend.B
                   and len(inflight) < IN_FLIGHT * backend.B):
                item = prompts.next()
                if item is None:
                    exhausted = True
                    break
                conv, first_ids = item
                todo = samples_to_write(conv)
                bar.update(len(dec.sample_ids(conv.sample_id)) - len(todo))
                for sid in todo:
                    st = ConvState(sid, conv.messages, order=order, first_ids=first_ids)
                    order += 1
                    admitted += 1
                    inflight.append(st)
                    fresh.append(st)
            for req in regen.next_requests(fresh):           # one batched tokenizer call per round
                _queue(ready, req)
            t_d = time.perf_counter()
            split["tokenize_s"] += t_d - t_c
            head = 0
            while head < len(inflight) and inflight[head].done:
                head += 1
            pending_rows.extend(inflight[:head])
            del inflight[:head]
            finished = exhausted and not inflight
            if pending_rows and (finished or len(pending_rows) >= backend.B
                                 or time.perf_counter() - last_flush >= FLUSH_SECONDS):
                flush()
            t_e = time.perf_counter()
            split["write_s"] += t_e - t_d
            if finished:
                break
            completions = backend.collect() if launched else []
            split["collect_s"] += time.perf_counter() - t_e
            if not launched and not ready and exhausted:
                raise RuntimeFailure(f"regenerate stalled with {len(inflight)} conversations in flight (a bug)")
    finally:
        writer.close()
        prompts.close()
        bar.close()
        if backend is not None:
            backend.close()                  # no queued device work outlives the run (overlap mode's streams)
    state["timing"] = _timing(split, backend, time.perf_counter() - t0)    # informational, this run only
    atomic_write_json(sidecar_path(output), state)
    print("regenerate: time split: " + ", ".join(f"{k} {v}" for k, v in state["timing"].items()), flush=True)
    notes = [f"the counters leave out {state['rows_uncounted']} rows written before a crash"] \
        if state.get("rows_uncounted") else []
    if dec.samples > 1:
        notes.append(f"{state.get('duplicate_rows', 0)} rows repeat an earlier sample of theirs "
                     f"({state.get('duplicate_tokens', 0):,} tokens)")
    print(f"regenerate: {output}: {state['rows_written']} conversations, {len(state['skipped'])} skipped "
          f"({state['prompts_too_long']} prompts too long ({limit}), {state['empty_answers']} empty answers, "
          f"{state.get('template_errors', 0)} prompts the chat template failed on), {state['generated_tokens']:,} "
          f"tokens generated ({state['truncated_responses']} responses hit --max-new-tokens)"
          + "".join(f"; {n}" for n in notes), flush=True)
    return state
