"""bench/quality_home.sh: the compiled trainer's kernel cache goes home once and back to a fresh machine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _driver(q: Path, out: Path, body: str, flags: str = "--compile on", env: dict | None = None):
    """The driver's kernels_out / restore_kernels / stash, as the driver calls them (say / fail stubbed)."""
    script = f"""
        say() {{ echo "$*"; }}; fail() {{ echo "FAIL: $*"; exit 1; }}
        Q={q}; CARRY={q}/carry; OUT={out}; SRC={q}/src; PY={sys.executable}; TRAIN_FLAGS=({flags})
        mkdir -p "$Q/logs" "$Q/done" "$OUT"; cd {ROOT}; source bench/quality_home.sh
        {body}
    """
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_the_compile_cache_goes_home_once_and_a_fresh_machine_starts_from_it(tmp_path):
    q, out = tmp_path / "machine1", tmp_path / "out1"
    cache = q / "kernels" / "train-rank0"
    # a cache over the 1 MiB cap raw but not compressed (generated code is text): sent, in one part
    big_source = b"".join(b"def kernel_%d(x):\n    return x * %d + 1\n" % (i, i) for i in range(60000))
    for rel, data in {"triton/K1/flex.cubin": os.urandom(4000), "inductor/fxgraph/a/b": b"graph",
                      "inductor/code/k.py": big_source}.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    assert len(big_source) > 2 ** 20
    r = _driver(q, out, "kernels_out; kernels_out", env={"QUALITY_KERNELS_MAX_MIB": "1"})   # two train jobs: sent once
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["kernels_train_rank0.tar.part-0-of-1"] and r.stdout.count("drafter_parts: kernels") == 1

    # a fresh machine: the parts come back through a stash call (.gpucarry/k0), setup restores them
    q2 = tmp_path / "machine2"
    (q2 / "src" / "k0").mkdir(parents=True)
    (q2 / "src" / "k0" / parts[0]).write_bytes((out / parts[0]).read_bytes())
    r = _driver(q2, tmp_path / "out2", "stash_into \"$CARRY/kernels\" \"$SRC\"/k*/kernels_*.tar.part-*; "
                                       "restore_kernels; restore_kernels; kernels_out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _tree(q2 / "kernels" / "train-rank0") == _tree(cache)
    assert r.stdout.count("compile cache restored") == 1                # once, not again in a later call
    assert not list((tmp_path / "out2").iterdir())                      # what came from home is not sent back


def test_no_cache_goes_home_without_compiling_or_over_the_size_cap(tmp_path):
    q = tmp_path / "m"
    (q / "kernels" / "train-rank0").mkdir(parents=True)
    (q / "kernels" / "train-rank0" / "big").write_bytes(os.urandom(2 * 2 ** 20))
    r = _driver(q, tmp_path / "o1", "kernels_out", flags="--seed 1")     # an eager trainer: nothing to send
    assert r.returncode == 0 and not list((tmp_path / "o1").iterdir())
    r = _driver(q, tmp_path / "o2", "kernels_out", env={"QUALITY_KERNELS_MAX_MIB": "1"})
    assert r.returncode == 0 and "over QUALITY_KERNELS_MAX_MIB=1 packed: not sent" in r.stdout   # random bytes:
    # 2 MiB after zstd too
    assert not list((tmp_path / "o2").iterdir())
    r = _driver(q, tmp_path / "o3", "restore_kernels")                  # nothing carried: nothing restored
    assert r.returncode == 0 and "restored" not in r.stdout
