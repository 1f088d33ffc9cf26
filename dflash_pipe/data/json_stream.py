"""Incremental reader for JSON files: a top-level array (or concatenated values), element by element.

Why not ``json.load``: the embedded ShareGPT file is 125 MB and is cut off in the middle of its
last conversation, so ``json.load`` fails on it and, even on a good file, would hold the whole
decoded list in memory. This reader keeps only a window of the text and hands out one element
at a time, with the 1-based line where the element starts.

How it works: the text comes from a buffered reader in chunks; each element is parsed with
``json.JSONDecoder.raw_decode`` (the C scanner) straight from the window. When that fails, a small
bracket/string-aware scanner (`_element_end`) decides whether the element is merely incomplete
(read more text and retry, reading geometrically more for huge elements) or complete but broken
(report it as ``bad_json`` and continue after it). At end of file, an incomplete element is one
``truncated`` record; nothing is reported when only the closing ``]`` is missing.

Leniency, on purpose: missing or trailing commas between elements are tolerated, a top-level
value other than an array is read as a sequence of concatenated values (a single object, or
JSON Lines saved as ``.json``). Bytes that are not UTF-8 are decoded with ``surrogateescape``,
so they surface as lone surrogates inside strings, which the row validator reports as
``invalid_utf8`` (outside strings they make the element ``bad_json``).
A broken bracket structure inside one element may swallow the elements after it: there is no
reliable resynchronisation for arbitrary broken JSON, and such files are reported, not guessed.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from typing import IO, Any, Iterator

_WS = re.compile(r"[ \t\n\r]*")
_STRUCT = re.compile(r'["{}\[\]]')
# Rest of a JSON string after its opening quote ("unrolled loop": no catastrophic backtracking).
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SCALAR_END = re.compile(r"[,\]\s]")
_DECODER = json.JSONDecoder()


@dataclass
class JsonRecord:
    """One element: `value` when it parsed, else `error` ('bad_json' / 'truncated') and `detail`."""

    index: int            # 1-based element index in the file (malformed ones included)
    line: int             # 1-based line of the element's first character
    value: Any = None
    error: str | None = None
    detail: str = ""


def _element_end(buf: str, pos: int) -> int | None:
    """End offset of the element starting at buf[pos] (non-blank), or None if buf ends first.

    Counts {}/[] depth outside strings; does not check that brackets match in kind, so
    that it finds the extent of broken elements too.
    """
    first = buf[pos]
    if first not in '{["':
        m = _SCALAR_END.search(buf, pos)
        return m.start() if m else None
    depth = 0
    i = pos
    while True:
        m = _STRUCT.search(buf, i)
        if m is None:
            return None
        ch, i = m.group(), m.end()
        if ch == '"':
            s = _STRING_REST.match(buf, i)
            if s is None:
                return None
            i = s.end()
            if depth == 0:
                return i
        elif ch in "{[":
            depth += 1
        else:
            depth -= 1
            if depth <= 0:
                return i


class _Window:
    """A sliding text window over the reader with absolute line tracking."""

    def __init__(self, text: IO[str], chunk_chars: int):
        self.text = text
        self.chunk = chunk_chars
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._line = 1          # line number at self._line_pos
        self._line_pos = 0
        self._first = True

    def fill(self, at_least: int = 0) -> bool:
        """Append at least one chunk (or `at_least` chars); drop consumed text. False at EOF."""
        if self.eof:
            return False
        self.line_at(self.pos)                   # bring the line counter up to pos before dropping
        self.buf = self.buf[self.pos:]
        self._line_pos -= self.pos
        self.pos = 0
        data = self.text.read(max(self.chunk, at_least))
        if not data:
            self.eof = True
            return False
        if self._first:
            self._first = False
            if data.startswith("\ufeff"):
                data = data[1:]                  # UTF-8 byte-order mark
        self.buf += data
        return True

    def line_at(self, offset: int) -> int:
        if offset >= self._line_pos:
            self._line += self.buf.count("\n", self._line_pos, offset)
            self._line_pos = offset
            return self._line
        return self._line - self.buf.count("\n", offset, self._line_pos)

    def skip_ws(self) -> bool:
        """Move pos to the next non-blank character; False if the file ends first."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return True
            if not self.fill():
                return False


def _parse_element(win: _Window, index: int) -> JsonRecord | None:
    """Parse the element at win.pos (non-blank). None means: nothing but EOF after it."""
    start_line = win.line_at(win.pos)
    grow = 0
    while True:
        buf, pos = win.buf, win.pos
        try:
            value, end = _DECODER.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            end = _element_end(buf, pos)
            if end is None:
                grow = max(grow * 2, len(buf) - pos)
                if win.fill(grow):
                    continue
                return JsonRecord(index, start_line, error="truncated",
                                  detail=f"file ends inside this element ({len(win.buf) - win.pos} chars)")
            win.pos = end
            return JsonRecord(index, start_line, error="bad_json", detail=f"{exc.msg} at line {win.line_at(exc.pos)}")
        if not isinstance(value, (dict, list, str)) and not win.eof and _SCALAR_END.search(buf, pos) is None:
            grow = max(grow * 2, len(buf) - pos)
            if win.fill(grow):                   # a number running into the window's edge may continue
                continue
        win.pos = end
        return JsonRecord(index, start_line, value=value)


def iter_json_values(text: IO[str], chunk_chars: int = 1 << 20) -> Iterator[JsonRecord]:
    """Yield the elements of a top-level JSON array (or the concatenated top-level values)."""
    win = _Window(text, chunk_chars)
    if not win.skip_ws():
        yield JsonRecord(1, 1, error="bad_json", detail="the file is empty")
        return
    in_array = win.buf[win.pos] == "["
    if in_array:
        win.pos += 1
    index = 0
    while True:
        if not win.skip_ws():
            return                               # EOF between elements: nothing was lost
        ch = win.buf[win.pos]
        if in_array and ch == "]":
            win.pos += 1
            if win.skip_ws():
                yield JsonRecord(index + 1, win.line_at(win.pos), error="bad_json",
                                 detail="unexpected data after the closing ']' (ignored)")
            return
        if ch == ",":                            # separators (and stray extra ones) are skipped
            win.pos += 1
            continue
        index += 1
        record = _parse_element(win, index)
        yield record
        if record.error == "truncated":
            return


def open_json_text(path: str, chunk_bytes: int = 1 << 20) -> io.TextIOWrapper:
    """Buffered UTF-8 text reader that never raises on bad bytes (see module docstring)."""
    raw = open(path, "rb", buffering=chunk_bytes)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")
