"""The window ledger: which shards a streaming (`train --follow --passes-per-shard K`) run holds.

``window.json`` in the cache dir records, per shard, the commit order (a sequence number the
trainer's rank 0 assigns the first time it sees the shard's sidecar), its bytes and its state:

    held      committed, still to be read by some round
    retired   no round after `retired_after_round` reads it; its file stays until a complete
              checkpoint at a later round boundary exists (a resume never needs a deleted shard)
    deleted   the parquet file is removed; the sidecar stays, so extraction's resume and the
              manifest still count the shard as committed

Only the trainer's rank 0 writes the ledger (atomically, with a sha256 of its content: a damaged
or hand-edited file is refused by name); extraction only reads it. `finished` is set once the
trainer has exported: the cache is then *consumed*, and the next extraction re-extracts the
deleted shards (`reset_consumed`).

A window group (`train --window-group DIR,DIR,...`: several drafters, e.g. recipe variants, streaming
one extraction) gives every trainer its own ledger, ``window-<hash of its output dir>.json``, listing
the whole group. There `deleted` means *released by this trainer*; the file goes once every member's
ledger has released it (`group_released`), by whichever member releases it last, and a member that
has not started yet holds every shard. Readers that ask which files are gone use `consumed_indices`:
the shards every ledger of the cache has released.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CacheError, ValidationError
from ..io_utils import fsync_dir, sha256_json
from .fs import CacheFS, open_cache_fs

WINDOW_FILE = "window.json"
GROUP_PREFIX = "window-"   # + 12 hex digits of the member's output dir + ".json"
HELD, RETIRED, DELETED = "held", "retired", "deleted"
_STATES = (HELD, RETIRED, DELETED)


@dataclass
class ShardEntry:
    index: int
    seq: int
    bytes: int
    state: str = HELD
    retired_after_round: int = -1


@dataclass
class Ledger:
    fingerprint: str
    passes_per_shard: int
    owner: str  # the training output dir that streams this cache
    shards: list[ShardEntry] = field(default_factory=list)  # in commit (seq) order
    finished: bool = False
    group: list[str] = field(default_factory=list)  # a window group's members (output dirs), this one included

    @property
    def file(self) -> str:
        """This ledger's file name in the cache dir."""
        return ledger_name(self.owner, self.group)

    # ------------------------------------------------------------------ queries
    def order(self) -> list[int]:
        """Shard indices in commit order (position = sequence number)."""
        return [e.index for e in self.shards]

    def entry(self, index: int) -> ShardEntry | None:
        for e in self.shards:
            if e.index == index:
                return e
        return None

    def in_state(self, state: str) -> list[ShardEntry]:
        return [e for e in self.shards if e.state == state]

    def deleted_indices(self) -> set[int]:
        return {e.index for e in self.shards if e.state == DELETED}

    # ------------------------------------------------------------------ transitions (trainer rank 0)
    def add(self, index: int, nbytes: int) -> ShardEntry:
        if self.entry(index) is not None:
            raise ValueError(f"shard {index} is already in the window ledger")
        e = ShardEntry(index, len(self.shards), int(nbytes))
        self.shards.append(e)
        return e

    def retire(self, seq: int, after_round: int) -> bool:
        e = self.shards[seq]
        if e.state != HELD:
            return False
        e.state, e.retired_after_round = RETIRED, after_round
        return True

    def deletable(self, before_round: int) -> list[ShardEntry]:
        """Retired shards that no read at or after round `before_round` needs."""
        return [e for e in self.shards if e.state == RETIRED and e.retired_after_round < before_round]

    # ------------------------------------------------------------------ (de)serialisation
    def to_json(self) -> dict:
        body = {"format": "dflash-pipe-window", "version": 1, "fingerprint": self.fingerprint,
                "passes_per_shard": self.passes_per_shard, "owner": self.owner, "finished": self.finished,
                "shards": [vars(e).copy() for e in self.shards]}
        if self.group:
            body["group"] = list(self.group)
        return {**body, "checksum": sha256_json(body)}


def ledger_name(owner: str, group: list[str] | tuple[str, ...] = ()) -> str:
    """window.json for a trainer alone; window-<12 hex of its output dir>.json for a group member."""
    if not group:
        return WINDOW_FILE
    return f"{GROUP_PREFIX}{hashlib.sha256(owner.encode()).hexdigest()[:12]}.json"


def ledger_names(fs: CacheFS, names=None) -> list[str]:
    """Every ledger file in the cache dir (window.json and group members'), sorted. `names`: a listing the caller
    already made (one listing is one request on object storage)."""
    names = fs.list_sizes() if names is None else names
    return sorted(n for n in names if n == WINDOW_FILE or (n.startswith(GROUP_PREFIX) and n.endswith(".json")))


def ledger_path(cache_dir: str | Path | CacheFS, name: str = WINDOW_FILE) -> Path | str:
    """Where a ledger is: a path, or an object's URI (for messages)."""
    fs = open_cache_fs(cache_dir)
    return fs.path(name) if fs.is_local else fs.display(name)


def load_ledger(cache_dir: str | Path | CacheFS, spec: dict | None = None, name: str = WINDOW_FILE) -> Ledger | None:
    """The ledger `name` of this cache, or None. Damage (bad JSON, checksum, fields) is a CacheError naming it."""
    fs = open_cache_fs(cache_dir)
    path = ledger_path(fs, name)
    hint = ("the window state was damaged or edited; if no window run is in progress delete it (and re-extract "
            "the shards it deleted), otherwise restore it from a backup")
    try:
        raw = json.loads(fs.read_bytes(name).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheError(f"{path}: window ledger is not valid JSON ({exc})", hint) from None
    if not isinstance(raw, dict) or "checksum" not in raw:
        raise CacheError(f"{path}: window ledger has no field 'checksum'", hint)
    body = {k: v for k, v in raw.items() if k != "checksum"}
    if sha256_json(body) != raw["checksum"]:
        raise CacheError(f"{path}: window ledger fails its checksum (field 'checksum')", hint)
    try:
        shards = [ShardEntry(int(s["index"]), int(s["seq"]), int(s["bytes"]), str(s["state"]),
                             int(s["retired_after_round"])) for s in body["shards"]]
        led = Ledger(str(body["fingerprint"]), int(body["passes_per_shard"]), str(body["owner"]), shards,
                     bool(body["finished"]), [str(g) for g in body.get("group", [])])
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheError(f"{path}: window ledger field missing or mistyped ({exc})", hint) from None
    for i, e in enumerate(led.shards):
        if e.seq != i or e.state not in _STATES:
            raise CacheError(f"{path}: shards[{i}]: seq {e.seq} / state {e.state!r} is inconsistent", hint)
    if spec is not None and led.fingerprint != spec["fingerprint"]:
        raise CacheError(f"{path}: window ledger belongs to a cache with fingerprint {led.fingerprint[:12]}, "
                         f"not this one's {spec['fingerprint'][:12]}", hint)
    return led


def save_ledger(cache_dir: str | Path | CacheFS, ledger: Ledger) -> None:
    open_cache_fs(cache_dir).write_json(ledger.file, ledger.to_json())  # atomic: rename, or one whole PUT


def load_ledgers(cache_dir: str | Path | CacheFS, spec: dict | None = None, names=None) -> list[Ledger]:
    """Every ledger of the cache (one per trainer streaming it), each checked as load_ledger checks it.
    `names`: the cache dir's listing, if the caller already has one."""
    fs = open_cache_fs(cache_dir)
    return [led for n in ledger_names(fs, names) if (led := load_ledger(fs, spec, n)) is not None]


def consumed_indices(cache_dir: str | Path | CacheFS, spec: dict | None = None,
                     ledgers: list[Ledger] | None = None) -> set[int]:
    """Shards whose files the window run(s) removed or may remove: deleted in every ledger of the cache, and in
    a group only once every member has a ledger (a member not started yet holds every shard). `ledgers`: the
    cache's ledgers, if the caller has loaded them (else they are read here)."""
    if ledgers is None:
        ledgers = load_ledgers(cache_dir, spec)
    if not ledgers:
        return set()
    group = {g for led in ledgers for g in led.group}
    if group - {led.owner for led in ledgers}:
        return set()
    out = ledgers[0].deleted_indices()
    for led in ledgers[1:]:
        out &= led.deleted_indices()
    return out


def member_ledgers(cache_dir: str | Path | CacheFS, spec: dict | None, ledger: Ledger) -> dict[str, Ledger | None]:
    """The other members of `ledger`'s group, by owner, as stored now (None: not started yet)."""
    return {owner: load_ledger(cache_dir, spec, ledger_name(owner, ledger.group))
            for owner in ledger.group if owner != ledger.owner}


def group_released(cache_dir: str | Path | CacheFS, spec: dict | None, ledger: Ledger, index: int,
                   members: dict[str, Ledger | None] | None = None) -> bool:
    """Whether every member of `ledger`'s group (itself included, as in memory) has released shard `index`.
    `members`: member_ledgers() read once for several shards (else read here)."""
    e = ledger.entry(index)
    if e is None or e.state != DELETED:
        return False
    if members is None:
        members = member_ledgers(cache_dir, spec, ledger)
    for other in members.values():
        e = other.entry(index) if other is not None else None
        if e is None or e.state != DELETED:
            return False
    return True


def delete_shard_file(cache_dir: str | Path | CacheFS, name: str) -> None:
    """Remove a retired shard's parquet file or object (its sidecar stays). Idempotent."""
    fs = open_cache_fs(cache_dir)
    fs.delete(name)
    if fs.is_local:
        fsync_dir(fs.root)


def check_owner(ledger: Ledger, owner: str, passes: int, path: Path) -> None:
    if ledger.owner != owner and not ledger.finished:
        raise ValidationError(f"{path}: the cache is being streamed by the training run {ledger.owner}, not "
                              f"{owner}", "resume that run (same --output-dir), or use another --cache-dir")
    if ledger.passes_per_shard != passes and not ledger.finished:
        raise ValidationError(f"{path}: the window run reads every shard {ledger.passes_per_shard} times, this "
                              f"run asks for --passes-per-shard {passes}", "resume with the original value")


def reset_consumed(cache_dir: str | Path | CacheFS, spec: dict, sidecar_of) -> list[int]:
    """Extraction, rank 0: a finished window run consumed this cache. Drop the ledger and the sidecars of
    the deleted shards (and the manifest) so they are extracted again. Returns the shards to redo.
    `sidecar_of(i)`: the sidecar's path or name (only its name is used)."""
    from .manifest import MANIFEST_FILE

    fs = open_cache_fs(cache_dir)
    ledgers = load_ledgers(fs, spec)
    if not ledgers or not all(led.finished for led in ledgers):   # a group: every member finished
        return []
    redo = sorted(consumed_indices(fs, spec, ledgers))
    for i in redo:
        fs.delete(Path(sidecar_of(i)).name)
    fs.delete(MANIFEST_FILE)
    for led in ledgers:
        fs.delete(led.file)
    if fs.is_local:
        fsync_dir(fs.root)
    return redo


def window_status(cache_dir: str | Path | CacheFS, spec: dict) -> dict | None:
    """`cache info`'s view of the window: shards held / retired / deleted / pending, bytes on disk."""
    fs = open_cache_fs(cache_dir)
    ledgers = load_ledgers(fs, spec)
    if not ledgers:
        return None
    from .schema import shard_name

    led = ledgers[0]                     # a group: the first member's view; `group` lists every member's state
    n = int(spec["num_shards"])
    sizes = fs.list_sizes()
    on_disk = {i: sizes[shard_name(i, n)] for i in range(n) if shard_name(i, n) in sizes}
    known = set(led.order())
    gone = consumed_indices(fs, spec, ledgers)
    out = {"passes_per_shard": led.passes_per_shard, "owner": led.owner, "finished": led.finished,
           "consumed": all(x.finished for x in ledgers) and bool(gone),
           "commit_order": led.order(),
           "held": [e.index for e in led.in_state(HELD)], "retired": [e.index for e in led.in_state(RETIRED)],
           "deleted": sorted(gone), "pending": [i for i in range(n) if i not in known],
           "bytes_on_disk": sum(on_disk.values()), "shard_files_on_disk": len(on_disk)}
    if led.group:
        out["group"] = {x.owner: {"finished": x.finished, "released": len(x.deleted_indices())} for x in ledgers}
    return out
