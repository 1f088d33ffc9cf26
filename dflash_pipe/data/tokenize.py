"""Tokenize conversations with the target's chat template and mark the tokens to train on.

The drafter learns to predict what the target *generates*, so ``loss_mask`` is 1 exactly on:

* the tokens of every assistant message's content, and
* the end-of-turn token that directly follows that content in the rendered template
  (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``...), because the target emits it
  to stop. It is included only if it is a special token of the tokenizer and nothing but
  whitespace separates it from the content. Template text around it (the newline after
  ``<|im_end|>``, the next ``<|im_start|>user``) is prompt, not generation, and stays 0.

Everything else (system / user turns, role headers, default system prompts the template adds)
is 0. Blank assistant messages supervise nothing.

How the spans are found, for any template: the conversation is rendered once with
``tokenize=False``. Each message's content is then located in that text in order, advancing a
cursor; for an assistant message the search starts no earlier than the end of the rendered
prefix ``messages[:i]`` + generation prompt, when that prefix is a prefix of the full text
(it is for ordinary templates; templates that re-render history differently, e.g. by
dropping reasoning, fall back to the cursor alone). Contents the template trims are found by
their stripped text. An assistant content that cannot be found is ``template_mismatch`` rather
than a guess. Character spans become token positions through the fast tokenizer's offset
mapping: a token is supervised if its characters overlap an assistant span (a token straddling
the boundary, such as a merged ``"\\n\\n"``, counts as content).

The rendered text is tokenized with ``add_special_tokens=False``, as ``apply_chat_template``
does: templates that want a BOS write it themselves. Plain-text documents are tokenized with
the tokenizer's default special tokens and supervised everywhere except the first token.
Truncation keeps the first ``max_length`` tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TypeVar

import numpy as np

from ..errors import DataError, DFlashError, UsageError, ValidationError
from .normalize import RowProblem
from .sources import Conversation
from .stats import DataStats

T = TypeVar("T")


@dataclass
class TokenizedSample:
    sample_id: str
    input_ids: np.ndarray         # int32 [T]
    loss_mask: np.ndarray         # uint8 [T], 1 = train on this token
    source: str = ""
    line: int = 0
    original_length: int = 0      # tokens before truncation

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def truncated(self) -> bool:
        return self.original_length > self.num_tokens


def _tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def chat_template_hash(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """sha256 of the template in use (None if there is none), for the cache provenance."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids that may end an assistant turn: all special tokens, eos, and added tokens marked special."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(idx))
    return ids


class ConversationTokenizer:
    """Reusable tokenizer for one (tokenizer, template, max_length): caches the special ids."""

    def __init__(self, tokenizer: Any, max_length: int, chat_template: str | None = None):
        if max_length < 2:
            raise UsageError(f"max_length must be at least 2 tokens, got {max_length}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValidationError(f"tokenizer {_tokenizer_name(tokenizer)} is not a fast (Rust) tokenizer",
                                  "loss masks need character offsets; load it with use_fast=True / a tokenizer.json")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.chat_template = chat_template
        self.end_ids = special_token_ids(tokenizer)

    @property
    def has_template(self) -> bool:
        return self.chat_template is not None or getattr(self.tokenizer, "chat_template", None) is not None

    def require_chat_template(self) -> None:
        if not self.has_template:
            raise ValidationError(
                f"tokenizer {_tokenizer_name(self.tokenizer)} has no chat template, so conversations cannot "
                "be rendered the way the target sees them",
                "pass a Jinja chat template (chat_template=... / a tokenizer_config.json that has one), "
                "or use --format text for plain documents")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        kwargs = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        out = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        if not isinstance(out, str):
            raise ValidationError(f"tokenizer {_tokenizer_name(self.tokenizer)}: apply_chat_template(tokenize=False) "
                                  f"returned {type(out).__name__}, not a string",
                                  "this transformers version is not supported; use transformers>=5.17")
        return out

    # ------------------------------------------------------------------ spans

    def _prefix_end(self, messages: list[dict[str, str]], i: int, rendered: str) -> int:
        """End of render(messages[:i], generation prompt) if it prefixes the full text, else 0."""
        if i == 0:
            return 0
        try:
            prefix = self.render(messages[:i], add_generation_prompt=True)
        except Exception:       # a template may refuse a history that ends on its own terms
            return 0
        return len(prefix) if rendered.startswith(prefix) else 0

    def assistant_spans(self, messages: list[dict[str, str]], rendered: str) -> list[tuple[int, int]]:
        """Character spans [a, b) of the assistant contents inside `rendered`."""
        spans, cursor = [], 0
        for i, msg in enumerate(messages):
            content, is_assistant = msg["content"], msg["role"] == "assistant"
            if not content.strip():
                continue
            lo = max(cursor, self._prefix_end(messages, i, rendered)) if is_assistant else cursor
            # the text as written or as a trimming template (Llama-3's `| trim`) renders it, whichever comes first
            # (the longer on a tie): the untrimmed text may also occur later, e.g. "Yes\n" answered, then quoted
            # by the next user turn, and taking that later one masked the user's text instead of the answer
            found = None
            for needle in (content, content.strip()):
                at = rendered.find(needle, lo)
                if at >= 0 and (found is None or at < found[0]):
                    found = (at, at + len(needle))
            if found is None:
                if is_assistant:
                    raise RowProblem("template_mismatch", f"messages[{i}].content",
                                     "the chat template does not reproduce this assistant message's text")
                continue        # a system/user text the template rewrites: keep the cursor
            if is_assistant:
                spans.append(found)
            cursor = found[1]
        return spans

    def _chat(self, conv: Conversation) -> tuple[list[int], np.ndarray]:
        self.require_chat_template()
        try:
            rendered = self.render(conv.messages)
        except DFlashError:
            raise
        except Exception as exc:
            raise RowProblem("template_error", "messages",
                             f"the chat template failed: {type(exc).__name__}: {exc}") from None
        spans = self.assistant_spans(conv.messages, rendered)
        enc = self.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= (starts < b) & (ends > a) & (ends > starts)
            j = int(np.searchsorted(starts, b, side="left"))
            while j < len(ids) and ends[j] <= starts[j] and ids[j] not in self.end_ids:
                j += 1          # skip zero-width tokens
            if j < len(ids) and ids[j] in self.end_ids and not rendered[b:starts[j]].strip():
                mask[j] = True
        return ids, mask.astype(np.uint8)

    def _text(self, conv: Conversation) -> tuple[list[int], np.ndarray]:
        ids = list(self.tokenizer(conv.text, add_special_tokens=True)["input_ids"])
        mask = np.ones(len(ids), dtype=np.uint8)
        mask[:1] = 0
        return ids, mask

    # ------------------------------------------------------------------ public

    def __call__(self, conv: Conversation, stats: DataStats | None = None,
                 strict: bool = False) -> TokenizedSample | None:
        """The sample, or None if the row is malformed here (counted in `stats`; raised if strict)."""
        try:
            ids, mask = self._text(conv) if conv.is_text else self._chat(conv)
            original = len(ids)
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            if not mask.any():
                why = "after truncation to max_length" if original > len(ids) else "in this row"
                raise RowProblem("no_supervised_tokens", "messages" if not conv.is_text else "text",
                                 f"no assistant tokens {why} ({original} tokens, max_length {self.max_length})")
        except RowProblem as p:
            where = f"{conv.source}:{conv.line}"
            if strict:
                raise DataError(f"{where}: {p.reason} in field '{p.field}' (sample {conv.sample_id}): {p.detail}",
                                "fix or delete this row, or run without --strict to skip and count it") from None
            if stats is not None:
                stats.add_malformed(p.reason, where, f"{p.field}: {p.detail}")
            return None
        sample = TokenizedSample(conv.sample_id, np.asarray(ids, dtype=np.int32), mask, conv.source,
                                 conv.line, original)
        if stats is not None:
            stats.samples += 1
            stats.tokens += sample.num_tokens
            stats.supervised_tokens += int(mask.sum())
            stats.truncated_samples += int(sample.truncated)
        return sample


def tokenize_conversation(tokenizer: Any, conv: Conversation, max_length: int, *, stats: DataStats | None = None,
                          strict: bool = False, chat_template: str | None = None) -> TokenizedSample | None:
    """One-off form of `ConversationTokenizer` (build that once when tokenizing many rows)."""
    return ConversationTokenizer(tokenizer, max_length, chat_template)(conv, stats, strict)


def iter_tokenized(tokenizer: ConversationTokenizer, conversations: Iterable[Conversation],
                   stats: DataStats | None = None, strict: bool = False) -> Iterator[TokenizedSample]:
    """Tokenize a stream, dropping (and counting) the rows that end up malformed."""
    for conv in conversations:
        sample = tokenizer(conv, stats, strict)
        if sample is not None:
            yield sample


# --------------------------------------------------------------------------- sharding

def _check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1:
        raise UsageError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise UsageError(f"shard index {shard} is outside 0..{num_shards - 1}")


def shard_of(sample_index: int, num_shards: int) -> int:
    """Shard of the i-th selected conversation (0-based, after skip/max): round robin."""
    _check_shard(0, num_shards)
    return sample_index % num_shards


def iter_shard(samples: Iterable[T], shard: int, num_shards: int) -> Iterator[tuple[int, T]]:
    """Yield (sample_index, item) for the items of `samples` that belong to `shard`.

    Shard on the selected conversations *before* tokenizing them, so each worker only tokenizes
    its own share; every worker walks the same deterministic stream, so the union of all shards
    is every sample exactly once. Rows dropped later by the tokenizer leave their index unused.
    """
    _check_shard(shard, num_shards)
    for i, item in enumerate(samples):
        if i % num_shards == shard:
            yield i, item
