"""Bring a trained drafter home from the GPU machine, and carry it back to a fresh one.

A quality run's GPU calls share the lent machine's disk only while it stays warm (30 s after each call). Sessions
16 and 17 lost a run's drafter when the next call found a new machine, so the driver sends each finished drafter
home in the call that finished it:

    python bench/drafter_parts.py pack --export /tmp/quality/train-lossless/export --out "$OUT" --name lossless
        -> $OUT/drafter_lossless.tar.part-0-of-3, ... (one tar, split in parts of at most --part-mib MiB; a
           PARTS.json member first holds every file's size and sha256)

and a later call (after `scripts/prepare_gpu_carry.sh` with DRAFTER_PARTS=<dir of those files> at home, and the
stash calls that carry them) restores it where the train job would have left it:

    python bench/drafter_parts.py unpack --parts /tmp/quality/carry/drafter --name lossless \\
        --dest /tmp/quality/train-lossless/export

Unpack checks that every part is there and every file's sha256, and writes the export directory atomically
(a temporary directory renamed into place), so a half-carried drafter is refused, never evaluated.

`--kind data` packs any flat directory the same way (data_<name>.tar.part-K-of-N): the regenerated data a run
needs beyond what main's tree can carry (scripts/prepare_gpu_carry.sh DATA_PARTS=<dir>; setup unpacks each
bundle to /tmp/quality/carry/files/<name>/). `--kind kernels` packs a directory tree (kernels_<name>..., a zstd-compressed tar):
the trainer's compiled-kernel caches (Triton + Inductor), so a later machine starts from a warm compile cache
(scripts/prepare_gpu_carry.sh KERNEL_PARTS=<dir>); `--max-mib` refuses a bundle over that size.
`pack-checkpoint` sends a train job's progress home while it still runs: its newest complete checkpoint, exported
(`dflash-pipe export`'s code) and packed as above, with PARTIAL.json (the checkpoint's step and the run's planned
steps) in the bundle. A machine lost before the job ends then costs the steps after that checkpoint, not the run;
the parts restore like a finished drafter's (DRAFTER_PARTS at home), PARTIAL.json saying what they are:

    python bench/drafter_parts.py pack-checkpoint --train-dir /tmp/quality/train-lossless --out "$OUT/partial" \
        --name lossless --sent /tmp/quality/partial-lossless.step     # nothing (exit 0) when that step was sent
Exit codes: 0 ok; 3 parts missing or damaged (carry them again), or no complete checkpoint yet; 2 usage.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

INDEX = "PARTS.json"


class PartsError(Exception):
    """Missing, extra or damaged parts: the drafter cannot be restored from them."""


KINDS = ("drafter", "data", "kernels")
TREES = ("kernels",)   # kinds whose bundles keep subdirectories (relative paths); the others are flat
# kinds whose tar is zstd-compressed: the compile cache is Triton / Inductor source, JSON and cubins (session 24's
# was 109 MiB raw, over what a run sends home uncompressed); a drafter's bf16 weights and the jsonl.xz data barely
# compress. unpack reads either form (a zstd frame is recognised by its magic number)
COMPRESSED = ("kernels",)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _part_names(name: str, n: int, kind: str = "drafter") -> list[str]:
    return [f"{kind}_{name}.tar.part-{i}-of-{n}" for i in range(n)]


def pack(export: Path, out: Path, name: str, part_mib: float = 15.0, kind: str = "drafter",
         max_mib: float | None = None) -> list[Path]:
    """The files of `export` (flat directory) -> parts in `out`; returns their paths. max_mib: refuse (PartsError,
    nothing written) a bundle larger than this after compression."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"{kind} name {name!r}: letters, digits and _ only (it becomes a file name in $OUT)")
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    if not export.is_dir():
        files = []
    elif kind in TREES:
        files = sorted(p for p in export.rglob("*") if p.is_file() and not p.is_symlink())
    else:
        files = sorted(p for p in export.iterdir() if p.is_file())
    if kind == "drafter" and not any(p.name == "config.json" for p in files):
        raise PartsError(f"{export} holds no config.json: not a drafter export (did the train job finish?)")
    if not files:
        raise PartsError(f"{export}: no files to pack")
    arc = {p: p.relative_to(export).as_posix() for p in files}
    index = {"name": name, "files": {arc[p]: {"bytes": p.stat().st_size,
                                              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files}}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = json.dumps(index, indent=1).encode()
        info = tarfile.TarInfo(INDEX)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for p in files:
            tar.add(p, arcname=arc[p], recursive=False)
    blob = buf.getvalue()
    if kind in COMPRESSED:
        import zstandard  # noqa: PLC0415 (a dflash-pipe dependency; only this kind needs it)

        blob = zstandard.ZstdCompressor(level=9).compress(blob)
    if max_mib is not None and len(blob) > max_mib * 2 ** 20:
        raise PartsError(f"{kind} {name!r}: {len(blob) / 2 ** 20:.1f} MiB packed"
                         f"{' (zstd)' if kind in COMPRESSED else ''}, over --max-mib {max_mib:g}: not packed")
    size = int(part_mib * 2 ** 20)
    chunks = [blob[i:i + size] for i in range(0, len(blob), size)]
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{kind}_{name}.tar.part-*"):     # a repacked bundle replaces the earlier parts
        old.unlink()
    paths = []
    for part, chunk in zip(_part_names(name, len(chunks), kind), chunks):
        tmp = out / (part + ".tmp")
        tmp.write_bytes(chunk)
        os.replace(tmp, out / part)
        paths.append(out / part)
    return paths


def _safe_member(fname: str, tree: bool) -> bool:
    """A member name unpack may write: a plain name, or (tree kinds) a relative path that stays inside dest."""
    parts = fname.split("/")
    if not tree and len(parts) > 1:
        return False
    return all(p not in ("", ".", "..") for p in parts) and not parts[0].startswith(".")   # "" catches a leading /


def unpack(parts_dir: Path, name: str, dest: Path, kind: str = "drafter") -> dict:
    """Parts in `parts_dir` -> the directory `dest` (atomically); returns the index."""
    found = sorted(parts_dir.glob(f"{kind}_{name}.tar.part-*-of-*")) if parts_dir.is_dir() else []
    if not found:
        raise PartsError(f"no {kind}_{name}.tar.part-*-of-* in {parts_dir}")
    totals = {int(p.name.rsplit("-of-", 1)[1]) for p in found}
    if len(totals) != 1:
        raise PartsError(f"{parts_dir}: parts of {kind} {name!r} from different packs ({sorted(totals)} parts)")
    want = _part_names(name, totals.pop(), kind)
    missing = [w for w in want if not (parts_dir / w).is_file()]
    if missing:
        raise PartsError(f"{parts_dir}: missing {', '.join(missing)} (carry every part; "
                         "scripts/prepare_gpu_carry.sh prints which call carries which)")
    blob = b"".join((parts_dir / w).read_bytes() for w in want)
    try:
        if blob[:4] == ZSTD_MAGIC:
            import zstandard  # noqa: PLC0415

            try:
                with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as r:
                    blob = r.read()
            except zstandard.ZstdError as exc:
                raise PartsError(f"{kind} {name!r}: the parts do not decompress ({exc}); carry them again") from exc
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
            members = {m.name: m for m in tar.getmembers()}
            if INDEX not in members:
                raise PartsError(f"{kind} {name!r}: no {INDEX} in the parts")
            index = json.loads(tar.extractfile(members[INDEX]).read())
            contents = {}
            for fname, meta in index["files"].items():
                m = members.get(fname)
                if m is None or not m.isfile() or not _safe_member(fname, kind in TREES):
                    raise PartsError(f"{kind} {name!r}: {fname} missing from the parts or not a plain file")
                data = tar.extractfile(m).read()
                if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                    raise PartsError(f"{kind} {name!r}: {fname} fails its sha256 (a damaged part; carry it again)")
                contents[fname] = data
    except (tarfile.TarError, EOFError, json.JSONDecodeError, KeyError) as exc:
        raise PartsError(f"{kind} {name!r}: the parts do not form its tar ({exc}); carry them again") from exc
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for fname, data in contents.items():
        (tmp / fname).parent.mkdir(parents=True, exist_ok=True)
        (tmp / fname).write_bytes(data)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return index


def pack_checkpoint(train_dir: Path, out: Path, name: str, sent: Path | None = None, part_mib: float = 15.0,
                    tries: int = 3) -> tuple[int, list[Path]] | None:
    """The newest complete checkpoint of `train_dir`, exported -> parts in `out` (PARTIAL.json inside); returns
    (step, part paths), or None when `sent` already names that step. The trainer prunes old checkpoints while
    this runs, so the three files the export needs are copied first; a checkpoint pruned meanwhile is retried
    with the next newest."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tempfile

    from dflash_pipe.train.checkpoint import MARKER, PREFIX, complete_checkpoints, read_state
    from dflash_pipe.train.exporting import export_checkpoint

    last = sent.read_text().strip() if sent is not None and sent.is_file() else ""
    for _ in range(tries):
        ckpts = complete_checkpoints(train_dir) if train_dir.is_dir() else []
        if not ckpts:
            raise PartsError(f"{train_dir}: no complete checkpoint yet")
        ckpt = ckpts[-1]
        step = int(ckpt.name[len(PREFIX):])   # ckpt-<step>: a step sent already is skipped before any copy
        if last == str(step):
            return None
        with tempfile.TemporaryDirectory(prefix="partial-") as tmp:
            copy = Path(tmp) / ckpt.name
            copy.mkdir()
            try:
                for f in ("model.safetensors", "state.json", MARKER):
                    shutil.copyfile(ckpt / f, copy / f)
            except FileNotFoundError:   # pruned under us: the next newest is complete by now
                continue
            state = read_state(copy)
            export = Path(tmp) / "export"
            export_checkpoint(copy, export)
            planned = state.get("total_steps")   # the step curve's length (a window run re-plans it as data arrives)
            (export / "PARTIAL.json").write_text(json.dumps(
                {"checkpoint": ckpt.name, "step": step, "planned_steps": planned, "train_dir": str(train_dir)}, indent=1))
            paths = pack(export, out, name, part_mib)
        if sent is not None:
            tmp_sent = sent.with_name(sent.name + ".tmp")
            tmp_sent.write_text(f"{step}\n")
            os.replace(tmp_sent, sent)
        return step, paths
    raise PartsError(f"{train_dir}: its newest checkpoint was pruned {tries} times while copying it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="an export directory -> <kind>_<name>.tar.part-K-of-N files")
    p.add_argument("--export", type=Path, required=True, help="the directory to pack (flat, or a tree for kernels)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--part-mib", type=float, default=15.0, help="largest part (the device returns files <= 16 MiB)")
    p.add_argument("--max-mib", type=float, default=None,
                   help="refuse a bundle larger than this, packed (kernels: after zstd); exit 3, nothing written")
    u = sub.add_parser("unpack", help="the parts -> the export directory, every file's sha256 checked")
    u.add_argument("--parts", type=Path, required=True)
    u.add_argument("--name", required=True)
    u.add_argument("--dest", type=Path, required=True)
    c = sub.add_parser("pack-checkpoint", help="a running train job's newest complete checkpoint, exported -> parts")
    c.add_argument("--train-dir", type=Path, required=True, help="the train job's --output-dir")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--sent", type=Path, default=None, help="file holding the step sent last (skip it; updated)")
    c.add_argument("--part-mib", type=float, default=15.0)
    for q in (p, u):
        q.add_argument("--kind", choices=KINDS, default="drafter",
                       help="drafter (an export), data (any flat directory) or kernels (a directory tree)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack-checkpoint":
            got = pack_checkpoint(args.train_dir, args.out, args.name, args.sent, args.part_mib)
            if got is None:
                print(f"drafter_parts: {args.name}: its newest checkpoint was sent already")
            else:
                print(f"drafter_parts: {args.name} at step {got[0]} (a checkpoint, PARTIAL.json inside) in "
                      f"{len(got[1])} part(s) in {args.out}")
        elif args.cmd == "pack":
            paths = pack(args.export, args.out, args.name, args.part_mib, args.kind, args.max_mib)
            print(f"drafter_parts: {args.kind} {args.name} in {len(paths)} part(s) of "
                  + ", ".join(f"{p.stat().st_size / 2**20:.1f}" for p in paths) + " MiB")
        else:
            index = unpack(args.parts, args.name, args.dest, args.kind)
            print(f"drafter_parts: {args.kind} {args.name} restored to {args.dest} ({len(index['files'])} files, sha256 checked)")
    except PartsError as exc:
        print(f"drafter_parts: error: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"drafter_parts: usage error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
