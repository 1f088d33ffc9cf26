"""Counters for what happened to the input rows: how many were read, kept, skipped and why.

Malformed rows are skipped (or, with ``strict=True``, raise `DataError`) and counted per
reason so that the manifest can say "17,634 conversations kept, 1 truncated tail, 3 with
no assistant turn" instead of silently training on less data than the user thinks. The
first few offenders are kept verbatim as ``"file:line: reason (detail)"`` so a user can go
and look at them.

Reason names are stable strings (they end up in manifests and in tests):

=====================  ==============================================================
``bad_json``           the row is not valid JSON
``truncated``          the file ends in the middle of a row
``invalid_utf8``       bytes that are not UTF-8, or a lone-surrogate ``\\udxxx`` escape
``not_an_object``      the row is a JSON value other than an object
``missing_field``      no ``conversations``/``messages``/``text`` (or the one ``format``
                       asks for), or a message without its role / content key
``bad_message``        the conversation is not a list, or one of its messages is not an object
``empty_conversation`` the conversation list is empty
``unknown_role``       a role other than user/human, assistant/gpt, system
``non_string_content`` a message content (or ``text``) that is not a string
``no_assistant_turn``  no assistant message with non-blank content
``empty_text``         a plain-text document that is empty or blank
``template_error``     the chat template raised on this conversation
``template_mismatch``  an assistant message's content cannot be found in the rendered template
``no_supervised_tokens`` nothing left to train on after tokenization / truncation
=====================  ==============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONS = (
    "bad_json", "truncated", "invalid_utf8", "not_an_object", "missing_field", "bad_message",
    "empty_conversation", "unknown_role", "non_string_content", "no_assistant_turn", "empty_text",
    "template_error", "template_mismatch", "no_supervised_tokens",
)


@dataclass
class DataStats:
    """Mutable counters shared by the readers (rows) and the tokenizer (samples, tokens)."""

    max_examples: int = 10
    rows: int = 0                      # records read from the files, valid or not
    conversations: int = 0             # valid conversations / documents yielded by the readers
    samples: int = 0                   # tokenized samples produced
    truncated_samples: int = 0         # samples cut to max_length
    tokens: int = 0                    # tokens in the produced samples (after truncation)
    supervised_tokens: int = 0         # tokens with loss_mask == 1
    malformed: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add_malformed(self, reason: str, where: str, detail: str = "") -> None:
        """Count one skipped row. `where` is ``"file:line"``."""
        if reason not in REASONS:
            raise ValueError(f"unknown malformed-row reason {reason!r} (known: {', '.join(REASONS)})")
        self.malformed[reason] = self.malformed.get(reason, 0) + 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    @property
    def total_malformed(self) -> int:
        return sum(self.malformed.values())

    def merge(self, other: "DataStats") -> None:
        """Add another worker's counters to these (examples are kept up to max_examples)."""
        for name in ("rows", "conversations", "samples", "truncated_samples", "tokens", "supervised_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, n in other.malformed.items():
            self.malformed[reason] = self.malformed.get(reason, 0) + n
        room = self.max_examples - len(self.examples)
        if room > 0:
            self.examples.extend(other.examples[:room])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for manifests (reasons sorted so the output is byte-stable)."""
        return {
            "rows": self.rows,
            "conversations": self.conversations,
            "samples": self.samples,
            "truncated_samples": self.truncated_samples,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "malformed": dict(sorted(self.malformed.items())),
            "malformed_total": self.total_malformed,
            "malformed_examples": list(self.examples),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataStats":
        s = cls()
        for name in ("rows", "conversations", "samples", "truncated_samples", "tokens", "supervised_tokens"):
            setattr(s, name, int(d.get(name, 0)))
        s.malformed = {str(k): int(v) for k, v in d.get("malformed", {}).items()}
        s.examples = [str(e) for e in d.get("malformed_examples", [])]
        return s

    def summary(self) -> str:
        """One line for the log: kept / skipped counts and the reasons."""
        head = f"{self.rows} rows read, {self.conversations} valid"
        if self.samples:
            head += f", {self.samples} tokenized ({self.truncated_samples} truncated)"
        if not self.malformed:
            return head + ", 0 malformed"
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.malformed.items()))
        return f"{head}, {self.total_malformed} malformed skipped ({reasons})"
