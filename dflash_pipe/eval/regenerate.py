"""`dflash-pipe regenerate`: rewrite the assistant turns of a dataset with the target's own answers.

A drafter learns to predict what the *target* generates, so training on the target's own
greedy responses (rather than on another model's ShareGPT answers) raises acceptance. This
command reads conversations with `dflash_pipe.data` (cfg.data source / format / skip / max /
strict) and writes OpenAI-format JSONL rows ``{"id", "messages"}`` that `extract` reads back.

Multi-turn, turn by turn: each assistant turn is replaced by the target's greedy response to
the conversation so far, where earlier assistant turns are already the regenerated ones and
user / system turns are kept verbatim. Details:
  * assistant turns before the first user turn are dropped (they answer nothing), and so is a
    trailing user turn after the last answer (nothing to train on);
  * a conversation stops (keeping the turns done so far) when the next prompt plus
    max_new_tokens would exceed cfg.extract.max_length tokens, which extraction would cut
    anyway, or when the target answers with nothing; if that happens at the first turn the
    conversation is skipped (recorded in the sidecar, so a rerun does not retry it);
  * a response that reaches max_new_tokens without an end-of-turn token is kept as it is
    (counted as truncated in the sidecar).
Conversations are processed in input order, `batch_size` at a time; within a batch every
round generates the next turn of all its unfinished conversations in one left-padded HF
`generate` call (greedy).

Resumable and crash-safe: the output is append-only; each batch's rows are written with one
write, then flush + fsync, and only then is the progress sidecar ``<output>.progress.json``
(written atomically) updated. A rerun with the same settings skips every id already in the
output (and the recorded skipped ids); a partially written last line (a killed writer) is
detected and cut off first. The sidecar also pins the settings (target weights, data
selection, max_new_tokens, max_length): resuming with different ones is refused instead of
mixing two datasets in one file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import RunConfig
from ..data import DataStats, load_conversations
from ..errors import UsageError, ValidationError
from ..io_utils import append_durably, atomic_write_json
from ..progress import progress_bar
from ..target import load_target
from .runner import encode_prompt, resolve_device
from .specdecode import eos_token_ids

log = logging.getLogger("dflash_pipe.eval")
SIDECAR_FORMAT = 1


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.json")


# --------------------------------------------------------------------------- resumable output

def scan_output(output: Path) -> set[str]:
    """Ids already in `output`; a partial last line (no newline) is cut off the file first."""
    done: set[str] = set()
    if not output.exists():
        return done
    good_end = 0
    with open(output, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break                                  # the killed writer's last line
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValidationError(f"{output}:{lineno}: a complete line is not valid JSON ({exc})",
                                      "this file was not written by `dflash-pipe regenerate`, or was edited; "
                                      "use a new --output") from None
            sid = row.get("id") if isinstance(row, dict) else None
            if not isinstance(sid, str) or not isinstance(row.get("messages"), list):
                raise ValidationError(f"{output}:{lineno}: row has no string 'id' or no 'messages' list",
                                      "use a new --output")
            if sid in done:
                raise ValidationError(f"{output}:{lineno}: id {sid!r} appears twice", "use a new --output")
            done.add(sid)
            good_end += len(raw)
    size = output.stat().st_size
    if size != good_end:
        log.warning("%s: dropping a partially written last line (%d bytes)", output, size - good_end)
        with open(output, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


class JsonlAppender:
    """Append-only JSONL output: one durable append per batch (fsynced; cut back on a disk error)."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        append_durably(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- generation

@dataclass
class _ConvState:
    sample_id: str
    source: list[dict]                                   # original messages
    out: list[dict] = field(default_factory=list)        # regenerated conversation so far
    cursor: int = 0
    done: bool = False
    skipped: str = ""                                    # reason, if the conversation yields nothing
    turns: int = 0                                       # assistant turns regenerated so far

    def next_prompt(self) -> list[dict] | None:
        """Advance to the next assistant turn; the messages before it, or None when finished."""
        while self.cursor < len(self.source):
            m = self.source[self.cursor]
            if m["role"] != "assistant":
                self.out.append(dict(m))
                self.cursor += 1
                continue
            if any(x["role"] == "user" for x in self.out):
                return list(self.out)
            self.cursor += 1                             # an answer to nothing: drop it
        self.finish("no assistant turn follows a user turn")
        return None

    def finish(self, reason_if_empty: str) -> None:
        while self.out and self.out[-1]["role"] != "assistant":
            self.out.pop()                               # trailing prompt turns train nothing
        self.done = True
        if not self.out:
            self.skipped = reason_if_empty


class Regenerator:
    """Greedy batched regeneration of conversations with one target (module docstring)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, max_length: int, max_turns: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_turns = max_turns
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        self.eos = eos_token_ids(model, tokenizer)
        if not self.eos:
            raise UsageError("the target defines no EOS token; regenerated answers would never end",
                             "use a model whose tokenizer or generation config names an eos_token_id")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if isinstance(pad, int) else self.eos[0]
        self.device = next(model.parameters()).device
        self.truncated = 0
        self.generated_tokens = 0

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):                  # left padding
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        gen = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, eos_token_id=self.eos,
                               pad_token_id=self.pad)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                      generation_config=gen)
        responses = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.eos), None)
            if cut is None:
                self.truncated += 1
            responses.append(row[:cut] if cut is not None else row)
            self.generated_tokens += len(responses[-1]) + (cut is not None)
        return responses

    def regenerate(self, batch: list[_ConvState]) -> None:
        """Replace every assistant turn of the batch's conversations, round by round."""
        while True:
            active, prompts = [], []
            for st in batch:
                if st.done:
                    continue
                if self.max_turns and st.turns >= self.max_turns:
                    st.finish("")
                    continue
                msgs = st.next_prompt()
                if msgs is None:
                    continue
                ids = encode_prompt(self.tokenizer, msgs)
                if len(ids) + self.max_new_tokens > self.max_length:
                    st.finish(f"first prompt + max_new_tokens exceeds max_length {self.max_length}")
                    continue
                active.append(st)
                prompts.append(ids)
            if not active:
                return
            for st, resp in zip(active, self._generate(prompts)):
                text = self.tokenizer.decode(resp, skip_special_tokens=True)
                if not text.strip():
                    st.finish("the target's first answer is empty")
                    continue
                st.out.append({"role": "assistant", "content": text})
                st.cursor += 1
                st.turns += 1


# --------------------------------------------------------------------------- command

def _settings(cfg: RunConfig, bundle, max_new_tokens: int, max_turns: int = 0) -> dict:
    d = cfg.data
    return {"target": cfg.target.model, "weights_fingerprint": bundle.identity.get("weights_fingerprint"),
            "chat_template_hash": bundle.identity.get("chat_template_hash"), "dtype": bundle.identity.get("dtype"),
            "source": d.source, "format": d.format, "skip_samples": d.skip_samples, "max_samples": d.max_samples,
            "max_new_tokens": max_new_tokens, "max_length": cfg.extract.max_length,
            "mode": "multi-turn" if not max_turns else f"first {max_turns} turn(s)"}


def _load_sidecar(output: Path, settings: dict) -> dict:
    side = sidecar_path(output)
    fresh = {"format": SIDECAR_FORMAT, "settings": settings, "rows_written": 0, "skipped": {},
             "generated_tokens": 0, "truncated_responses": 0, "seconds": 0.0}
    if not output.exists() or output.stat().st_size == 0:
        return fresh
    try:
        state = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValidationError(f"{output} exists but has no progress sidecar {side.name}",
                              "it was not written by `dflash-pipe regenerate`; pass a new --output") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValidationError(f"{side}: unreadable progress sidecar ({exc})", "pass a new --output") from None
    old = state.get("settings", {})
    # Conversations are answered in input order, so a file made with max_samples = N is the prefix of one
    # made with more: a larger (or unlimited, 0) max_samples extends it instead of being refused.
    grows = old.get("max_samples", 0) != 0 and (settings["max_samples"] == 0 or
                                                 settings["max_samples"] > old.get("max_samples", 0))
    diff = {k: (old.get(k), v) for k, v in settings.items()
            if old.get(k) != v and not (k == "max_samples" and grows)}
    if diff:
        lines = "; ".join(f"{k}: {a!r} in the file vs {b!r} now" for k, (a, b) in diff.items())
        raise ValidationError(f"{output} was generated with other settings ({lines})",
                              "rerun with the original settings to resume, or pass a new --output")
    return {**fresh, **state, "settings": settings}


def run_regenerate(cfg: RunConfig, output: Path, max_new_tokens: int = 512, batch_size: int = 16,
                   device: str = "auto", *, bundle=None, max_turns: int = 0) -> dict:
    """Regenerate cfg.data's conversations into `output` (JSONL); returns the final sidecar dict.

    bundle: an already loaded TargetBundle to use instead of loading cfg.target (tests, notebooks).
    """
    output = Path(output)
    if max_new_tokens < 1 or batch_size < 1:
        raise UsageError(f"--max-new-tokens ({max_new_tokens}) and --batch-size ({batch_size}) must be >= 1")
    if cfg.extract.max_length <= max_new_tokens:
        raise UsageError(f"--max-length ({cfg.extract.max_length}) must exceed --max-new-tokens ({max_new_tokens})")
    if bundle is None:
        t = cfg.target
        bundle = load_target(t.model, device=resolve_device(device), dtype=t.dtype, revision=t.revision,
                             trust_remote_code=t.trust_remote_code, seed=t.seed, model_cache_dir=t.model_cache_dir,
                             attn_implementation=t.attn_implementation)
    state = _load_sidecar(output, _settings(cfg, bundle, max_new_tokens, max_turns))
    done = scan_output(output)
    state["rows_written"] = len(done)       # the output is the truth (a crash may precede a sidecar update)
    skip = done | set(state["skipped"])
    atomic_write_json(sidecar_path(output), state)
    regen = Regenerator(bundle.model, bundle.tokenizer, max_new_tokens, cfg.extract.max_length, max_turns)
    stats = DataStats()
    d = cfg.data
    convs = load_conversations(d.source, d.format, d.strict, stats, d.skip_samples, d.max_samples)
    bar = progress_bar(d.max_samples or None, "regenerate", "conv")
    if done:
        print(f"regenerate: resuming {output}: {len(done)} conversations already written", flush=True)
    writer = JsonlAppender(output)
    t0, seconds0 = time.perf_counter(), float(state["seconds"])
    try:
        batch: list[_ConvState] = []
        for conv in _with_flush(convs):
            if conv is not None:
                if conv.is_text or conv.sample_id in skip:
                    bar.update(1)
                    continue
                batch.append(_ConvState(conv.sample_id, conv.messages))
                if len(batch) < batch_size:
                    continue
            if not batch:
                continue
            tokens_before = regen.generated_tokens
            regen.regenerate(batch)
            rows = [{"id": st.sample_id, "messages": st.out} for st in batch if not st.skipped]
            writer.append(rows)
            state["rows_written"] += len(rows)
            state["skipped"].update({st.sample_id: st.skipped for st in batch if st.skipped})
            state["generated_tokens"] += regen.generated_tokens - tokens_before
            state["truncated_responses"] += regen.truncated
            regen.truncated = 0
            state["seconds"] = seconds0 + time.perf_counter() - t0
            state["data_stats"] = stats.to_dict()
            atomic_write_json(sidecar_path(output), state)
            bar.update(len(batch), tokens=regen.generated_tokens - tokens_before)
            batch = []
    finally:
        writer.close()
        bar.close()
    print(f"regenerate: {output}: {state['rows_written']} conversations, {len(state['skipped'])} skipped, "
          f"{state['generated_tokens']:,} tokens generated ({state['truncated_responses']} responses hit "
          f"--max-new-tokens)", flush=True)
    return state


def _with_flush(items):
    """Yield the items, then one None (the signal to process the last, partial batch)."""
    yield from items
    yield None
