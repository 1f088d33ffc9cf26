"""Error classes, one per exit-code class.

Every error raised on purpose by dflash-pipe derives from `DFlashError`. The CLI maps
the class to a process exit code so scripts (and `run_pipeline.sh`) can tell a typo in
a flag from a corrupt shard from a crashed GPU:

    0  success
    2  UsageError        - the command line or run manifest is malformed (fix the flag/key)
    3  ValidationError   - inputs are well-formed but wrong (cache/config mismatch, corrupt
                           shard, bad data row under --strict); nothing was changed
    4  RuntimeFailure    - something failed while running (a rank died, disk full, NaN)
    130 interrupted      - Ctrl-C / SIGTERM; state on disk is resumable
"""

from __future__ import annotations


class DFlashError(Exception):
    """Base class. `hint` says what the user should do about it."""

    exit_code = 4

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(DFlashError):
    """Malformed command line or run manifest (unknown key, wrong type, bad flag)."""

    exit_code = 2


class ValidationError(DFlashError):
    """Well-formed input that is wrong: mismatched fingerprint, corrupt shard, bad row."""

    exit_code = 3


class CacheError(ValidationError):
    """A feature cache is damaged, foreign or inconsistent with its manifest."""


class FingerprintMismatch(ValidationError):
    """The cache on disk was produced from different target/data/extraction settings."""

    def __init__(self, message: str, differing: dict[str, tuple[object, object]], hint: str | None = None):
        super().__init__(message, hint)
        self.differing = differing


class DataError(ValidationError):
    """A malformed input data row (raised only in --strict mode; otherwise counted)."""


class RuntimeFailure(DFlashError):
    """A failure while running: I/O error, disk full, rank failure, non-finite features."""

    exit_code = 4


class DegenerateFeatures(RuntimeFailure):
    """Target features failed the write-time sanity check (NaN/Inf, all-zero, collapsed norms)."""
