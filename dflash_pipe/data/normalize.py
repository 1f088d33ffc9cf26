"""Turn one decoded row (ShareGPT, OpenAI messages or plain text) into normalised messages.

Accepted row shapes (``format="auto"`` picks per row, in this order of keys):

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}``
* OpenAI:   ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}``
* text:     ``{"text": str}``

Message keys are accepted in either spelling (``from``/``value`` or ``role``/``content``) in both
chat formats, because mixed exports are common. Roles are mapped to ``user`` / ``assistant`` /
``system``; anything else (``tool``, ShareGPT's ``bing``/``bard``/``chatgpt``) makes the row
``unknown_role``: we do not guess what another system's turns mean for the chat template.
Leading assistant turns and empty messages are kept verbatim (the chat template decides how they
render); a conversation needs at least one assistant message with non-blank content.

Problems raise `RowProblem(reason, field, detail)`; the caller counts or re-raises it (strict).
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system"}
FORMATS = ("auto", "sharegpt", "openai", "text")
_LIST_KEY = {"sharegpt": "conversations", "openai": "messages"}
_MSG_KEYS = {"sharegpt": (("from", "value"), ("role", "content")),
             "openai": (("role", "content"), ("from", "value"))}


class RowProblem(Exception):
    """A malformed row: `reason` is a `stats.REASONS` name, `field` the offending field path."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(f"{reason}: {field}: {detail}")
        self.reason = reason
        self.field = field
        self.detail = detail


def check_utf8(value: str, field: str) -> str:
    """Refuse strings that cannot be encoded as UTF-8 (undecodable bytes or lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowProblem("invalid_utf8", field,
                         f"character {exc.start} is not valid UTF-8 text ({value[exc.start]!r})") from None
    return value


def detect_format(row: dict[str, Any], format: str) -> str:
    """The row's format: `format` itself unless it is 'auto'."""
    if format != "auto":
        key = _LIST_KEY.get(format, "text")
        if key not in row:
            raise RowProblem("missing_field", key, f"format '{format}' needs a '{key}' field "
                             f"(row has: {', '.join(sorted(map(str, row))) or 'no keys'})")
        return format
    for key, fmt in (("conversations", "sharegpt"), ("messages", "openai"), ("text", "text")):
        if key in row:
            return fmt
    raise RowProblem("missing_field", "conversations|messages|text",
                     f"no 'conversations', 'messages' or 'text' field (row has: "
                     f"{', '.join(sorted(map(str, row))) or 'no keys'})")


def row_id(row: dict[str, Any]) -> str | None:
    """The row's own id (str or int), or None if absent/unusable."""
    value = row.get("id")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.strip():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return value
    return None


def _message(msg: Any, fmt: str, field: str) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise RowProblem("bad_message", field, f"a message must be an object, got {type(msg).__name__}")
    # the spelling is the one with a non-null key: Parquet stores a list of messages as structs with every key any
    # message of the column used, so {"role", "content"} messages come back with from=None, value=None beside them
    present = {k for k, v in msg.items() if v is not None}
    for role_key, content_key in _MSG_KEYS[fmt]:
        if role_key in present or content_key in present:
            break
    else:
        role_key, content_key = _MSG_KEYS[fmt][0]
    if role_key not in msg:
        raise RowProblem("missing_field", f"{field}.{role_key}", "message has no role")
    if content_key not in msg:
        raise RowProblem("missing_field", f"{field}.{content_key}", "message has no content")
    raw_role, content = msg[role_key], msg[content_key]
    role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise RowProblem("unknown_role", f"{field}.{role_key}",
                         f"role {raw_role!r} is not one of {', '.join(sorted(ROLE_ALIASES))}")
    if not isinstance(content, str):
        raise RowProblem("non_string_content", f"{field}.{content_key}",
                         f"content must be a string, got {type(content).__name__}")
    return {"role": role, "content": check_utf8(content, f"{field}.{content_key}")}


def normalize_row(row: Any, format: str) -> tuple[list[dict[str, str]], str | None, str | None]:
    """Validate a decoded row. Returns (messages, text, own_id); exactly one of messages/text is used.

    For chat rows `text` is None; for text rows `messages` is empty.
    """
    if not isinstance(row, dict):
        raise RowProblem("not_an_object", "<row>", f"expected a JSON object, got {type(row).__name__}")
    fmt = detect_format(row, format)
    own_id = row_id(row)
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str):
            raise RowProblem("non_string_content", "text", f"'text' must be a string, got {type(text).__name__}")
        check_utf8(text, "text")
        if not text.strip():
            raise RowProblem("empty_text", "text", "the document is empty")
        return [], text, own_id
    key = _LIST_KEY[fmt]
    conv = row[key]
    if not isinstance(conv, list):
        raise RowProblem("bad_message", key, f"'{key}' must be a list of messages, got {type(conv).__name__}")
    if not conv:
        raise RowProblem("empty_conversation", key, "the conversation has no messages")
    messages = [_message(m, fmt, f"{key}[{i}]") for i, m in enumerate(conv)]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RowProblem("no_assistant_turn", key, "no assistant message with non-blank content "
                         "(nothing to train the drafter on)")
    return messages, None, own_id
