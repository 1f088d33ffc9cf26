"""regenerate's conversations turn by turn (ConvState, Regenerator), and their first prompts tokenized ahead.

ConvState is one conversation (one sample of it) being regenerated: the messages so far, the next prompt, the
counters. Regenerator turns states into turn requests (tokenized prompts) and answers back into messages.

The driver loop is one host thread that launches the device's work, collects answers, detokenizes, tokenizes new
prompts and writes rows. On the H100 in session 25 (`bench/regen_throughput.py`, 8,192 first turns, batch 1,024) it
spent 3.1 s of a 10.1 s run tokenizing while the device was busy 8.5 s. Tokenized ahead, the loop's tokenizing
went from 5.5 to 1.4 s on all 13,829 prompts, but that run was device-bound and the time became waiting for the
device (1.007x, rows identical; BENCHMARKS.md, session 25): it pays where the host is slower. The first prompt of
a conversation depends only on its source messages, so it can be chat-templated and tokenized before the
conversation is admitted; later turns depend on the target's own answers and stay in the loop
(`Regenerator.next_requests`).

`PromptReadAhead` keeps up to `depth` chunks of `chunk` conversations read ahead: the reading stays on the loop's
thread (the reader and its DataStats are not shared between threads; a chunk is ~0.01 s of JSON), and each chunk's
first prompts go to one worker thread as one batched `encode_prompts` call, whose Rust tokenizer releases the GIL.
A conversation that will not be generated (a plain-text row, or every sample already written) is not tokenized.
The ids are exactly what `encode_prompts` gives the same messages in the loop, so the output does not change.

Read ahead means the data statistics (DataStats, in the sidecar) may count up to depth x chunk conversations that
a run stopped by --max-seconds never admitted; the output and the resume point do not depend on them.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Iterator

from .regen_requests import Completion, TurnRequest
from .regen_sampling import Decoding, answer_key
from .runner import encode_prompts

# a text the tokenizers' clean-up pass changes (spaces before punctuation and contractions): decode_texts' probe
CLEANUP_PROBE = "Yes , it 's done . Is n't it ? I 'm sure ! We 've seen , you 're right ; do n't"
COUNTERS = ("generated_tokens", "truncated_responses", "prompts_too_long", "empty_answers", "template_errors")


@dataclass
class ConvState:
    sample_id: str
    source: list[dict]                                   # original messages
    out: list[dict] = field(default_factory=list)        # regenerated conversation so far
    cursor: int = 0
    done: bool = False
    skipped: str = ""                                    # reason, if the conversation yields nothing
    turns: int = 0                                       # assistant turns regenerated so far
    order: int = 0                                       # input position (answers are written in this order)
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))   # the sidecar's counters
    first_ids: FirstPromptIds | None = None              # the first prompt, tokenized ahead (PromptReadAhead)

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
    """Turns conversations into turn requests and answers back into conversations (module docstring)."""

    def __init__(self, tokenizer, eos: list[int], max_new_tokens: int, max_length: int, max_turns: int,
                 dec: Decoding, limit: str = ""):
        self.tokenizer, self.eos, self.dec = tokenizer, eos, dec
        self.max_new_tokens, self.max_length, self.max_turns = max_new_tokens, max_length, max_turns
        self.limit = limit or f"max_length {max_length}"    # what max_length is, for the skip reasons
        self._batch_decode = None          # decode_texts: the batch decode that agrees, False if none (None: unprobed)

    def next_request(self, st: ConvState) -> TurnRequest | None:
        """The conversation's next turn to generate, or None (it is finished)."""
        reqs = self.next_requests([st])
        return reqs[0] if reqs else None

    def next_requests(self, states: list[ConvState]) -> list[TurnRequest]:
        """The next turn of each conversation that has one, all prompts tokenized in one batch."""
        todo = []
        for st in states:
            if st.done:
                continue
            if self.max_turns and st.turns >= self.max_turns:
                st.finish("")
                continue
            msgs = st.next_prompt()
            if msgs is not None:
                todo.append((st, msgs))
        reqs, failed, k = [], {}, 0
        encoded = encode_prompts(self.tokenizer, [m for st, m in todo if st.first_ids is None], failed)
        for st, _ in todo:
            if st.first_ids is None:
                ids, why = encoded[k], failed.get(k)
                k += 1
            else:
                ids, why = st.first_ids.ids(), st.first_ids.failed()   # (samples share theirs)
            st.first_ids = None
            if ids is None:                   # counted and skipped, as extraction skips such a row
                st.counts["template_errors"] += 1
                st.finish(f"{'first' if not st.turns else 'a'} prompt: {why}")
                continue
            ids = list(ids)
            if len(ids) + self.max_new_tokens > self.max_length:
                st.counts["prompts_too_long"] += 1
                st.finish(f"{'first' if not st.turns else 'a'} prompt of {len(ids)} tokens + max_new_tokens "
                          f"exceeds {self.limit}")
                continue
            reqs.append(TurnRequest(st, ids, answer_key(self.dec.seed, st.sample_id, st.turns), st.order))
        return reqs

    def record_all(self, comps: list[Completion]) -> list[ConvState]:
        """Record answers, detokenized in one batch (`decode_texts`); the conversations that may continue."""
        texts = self.decode_texts([c.tokens for c in comps])
        return [st for st in (self.record(c, t) for c, t in zip(comps, texts)) if st is not None]

    def decode_texts(self, seqs: list[list[int]]) -> list[str]:
        """The answers' texts as `tokenizer.decode(ids, skip_special_tokens=True)` gives them. A fast tokenizer
        decodes a batch in Rust: in parallel, without the GIL, and without transformers' per-token type check
        (`to_py_obj`: 1.9 s of a 13,829-answer H100 run's host time under cProfile, BENCHMARKS.md session 34).
        Whether that path gives the same texts is checked once, on the first answers (`_probe_batch_decode`); if
        not, the answers are decoded one by one for the whole run."""
        if self._batch_decode is None and seqs:
            self._batch_decode = self._probe_batch_decode(seqs[:8]) or False
        if self._batch_decode and len(seqs) > 1:
            return self._batch_decode(seqs)
        return [self.tokenizer.decode(q, skip_special_tokens=True) for q in seqs]

    def _probe_batch_decode(self, probe: list[list[int]]):
        """The Rust batch decode, as it is or followed by the tokenizer's clean-up pass, whichever gives what the
        one-by-one decode gives on `probe` plus a text the clean-up would change (" , it 's ..."): transformers
        versions differ on whether `decode` cleans up after a BPE tokenizer. None when neither agrees, or when
        there is no Rust backend, or when the tokenizer cannot encode the test text and says it cleans up."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            return None
        probe = list(probe)
        if callable(getattr(tok, "encode", None)):
            probe.append(list(tok.encode(CLEANUP_PROBE, add_special_tokens=False)))
        elif getattr(tok, "clean_up_tokenization_spaces", True):
            return None
        want = [tok.decode(q, skip_special_tokens=True) for q in probe]
        raw = backend.decode_batch(probe, skip_special_tokens=True)
        if raw == want:
            return lambda seqs: backend.decode_batch(seqs, skip_special_tokens=True)
        clean = getattr(tok, "clean_up_tokenization", None)
        if clean is not None and [clean(t) for t in raw] == want:
            return lambda seqs: [clean(t) for t in backend.decode_batch(seqs, skip_special_tokens=True)]
        return None

    def record(self, c: Completion, text: str | None = None) -> ConvState | None:
        """Record an answer (`text`: its decoded tokens, if decoded already); its conversation if it may continue
        (else None: it is finished)."""
        st: ConvState = c.request.state
        st.counts["generated_tokens"] += len(c.tokens) + c.ended
        st.counts["truncated_responses"] += not c.ended
        text = self.tokenizer.decode(c.tokens, skip_special_tokens=True) if text is None else text
        if not text.strip():
            st.counts["empty_answers"] += 1
            st.finish("the target's first answer is empty")
            return None
        st.out.append({"role": "assistant", "content": text})
        st.cursor += 1
        st.turns += 1
        return st

    def complete(self, c: Completion) -> TurnRequest | None:
        """Record an answer; the conversation's next request (or None)."""
        st = self.record(c)
        return None if st is None else self.next_request(st)


def first_prompt(messages: list[dict]) -> list[dict] | None:
    """A conversation's first prompt, as its ConvState builds it at turn 0; None when it has none."""
    return ConvState("", messages).next_prompt()


class FirstPromptIds:
    """One conversation's first prompt ids (None where the chat template failed on it), ready when its chunk's
    worker call returns."""
    __slots__ = ("_future", "_k")

    def __init__(self, future: Future, k: int):
        self._future, self._k = future, k

    def ids(self) -> list[int] | None:
        return self._future.result()[0][self._k]

    def failed(self) -> str | None:
        return self._future.result()[1].get(self._k)


class PromptReadAhead:
    """`next()` -> (conversation, FirstPromptIds or None), in input order; None at the end of the input.

    wanted(conv): whether the loop will generate for this conversation (its first prompt is worth tokenizing).
    enabled False: no thread, no read-ahead; every first prompt is tokenized in the loop as before."""

    def __init__(self, convs: Iterator, tokenizer, wanted: Callable[[object], bool], chunk: int = 256,
                 depth: int = 2, enabled: bool = True):
        self._convs, self._tok, self._wanted = convs, tokenizer, wanted
        self._chunk, self._depth = max(1, chunk), max(1, depth)
        self._queue: deque = deque()          # (conv, FirstPromptIds | None), read ahead, in input order
        self._ended = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-tokenize") if enabled else None

    def next(self):
        if self._pool is None:
            return (conv, None) if (conv := next(self._convs, None)) is not None else None
        while not self._ended and len(self._queue) < self._depth * self._chunk:
            self._read_chunk()
        return self._queue.popleft() if self._queue else None

    def _read_chunk(self) -> None:
        convs = list(islice(self._convs, self._chunk))
        if len(convs) < self._chunk:
            self._ended = True
        prompts = [first_prompt(c.messages) if self._wanted(c) else None for c in convs]
        todo = [p for p in prompts if p is not None]
        future = self._pool.submit(_encode_noting_failures, self._tok, todo) if todo else None
        k = 0
        for conv, p in zip(convs, prompts):
            if p is None:
                self._queue.append((conv, None))
            else:
                self._queue.append((conv, FirstPromptIds(future, k)))
                k += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _encode_noting_failures(tokenizer, prompts: list) -> tuple[list, dict[int, str]]:
    """encode_prompts on the read-ahead's worker: (ids or None per prompt, why each None failed)."""
    failed: dict[int, str] = {}
    return encode_prompts(tokenizer, prompts, failed), failed
