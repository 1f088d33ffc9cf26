"""bench/quality_home.sh: regenerated data carried from home as a data bundle, read by extraction after the
regen files (QUALITY_EXTRA_DATA), and refused when it holds a held-out conversation."""

import importlib.util
import json
import lzma
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("drafter_parts", ROOT / "bench" / "drafter_parts.py")
dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dp)


def _rows(ids):
    return "".join(json.dumps({"id": i, "messages": [{"role": "user", "content": i}]}) + "\n" for i in ids)


def _setup(q: Path, extra: str) -> subprocess.CompletedProcess:
    """The driver's restore_data_bundles + link_data, as setup calls them (say / fail stubbed)."""
    script = f"""
        say() {{ echo "$*"; }}; fail() {{ echo "FAIL: $*"; exit 1; }}
        Q={q}; CARRY={q}/carry; PY={sys.executable}; HELDOUT=2; REGEN_MORE_FLAGS=(--samples 1)
        export QUALITY_EXTRA_DATA="{extra}"
        mkdir -p "$Q/logs"; cd {ROOT}
        source bench/quality_home.sh
        restore_data_bundles && link_data && uses_data_dir && echo LINKED
    """
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def _machine(tmp_path, bundle_ids):
    q = tmp_path / "q"
    q.mkdir()
    (q / "regenerated.jsonl").write_text(_rows(["held_0#0", "held_0#1", "a#0", "a#1"]))  # first 2 rows held out
    home = tmp_path / "home"
    home.mkdir()
    with lzma.open(home / "more.jsonl.xz", "wt") as f:
        f.write(_rows(bundle_ids))
    (home / "more.progress.json").write_text("{}")
    dp.pack(home, q / "carry" / "databundle", "sample5", part_mib=0.0005, kind="data")   # several small parts
    return q


def test_a_carried_bundle_is_unpacked_and_read_after_the_regen_files(tmp_path):
    q = _machine(tmp_path, ["a#5", "b#5", "c#5"])
    assert len(list((q / "carry" / "databundle").glob("data_sample5.tar.part-*"))) > 1
    r = _setup(q, f"{q}/carry/files/sample5/more.jsonl.xz")
    assert r.returncode == 0 and "LINKED" in r.stdout, r.stdout + r.stderr
    assert "data bundle sample5 unpacked" in r.stdout and "extra data 1: 3 rows" in r.stdout
    assert sorted(p.name for p in (q / "data").iterdir()) == ["0-regenerated.jsonl", "1-regenerated-more.jsonl",
                                                             "2-extra.jsonl"]
    assert [json.loads(ln)["id"] for ln in (q / "data" / "2-extra.jsonl").read_text().splitlines()] == \
        ["a#5", "b#5", "c#5"]
    again = _setup(q, f"{q}/carry/files/sample5/more.jsonl.xz")   # a later call: nothing redone
    assert again.returncode == 0 and "unpacked" not in again.stdout and "extra data" not in again.stdout


def test_a_held_out_conversation_or_a_missing_file_is_refused(tmp_path):
    q = _machine(tmp_path, ["a#5", "held_0#5"])
    r = _setup(q, f"{q}/carry/files/sample5/more.jsonl.xz")
    assert r.returncode == 1 and "FAIL" in r.stdout
    assert "row 2: conversation 'held_0#5' is held out" in r.stderr
    assert not list(q.glob("extra-*")) and not (q / "data" / "2-extra.jsonl").exists()
    r = _setup(q, f"{q}/carry/files/nowhere.jsonl.xz")
    assert r.returncode == 1 and "is not a file" in r.stdout and "DATA_PARTS" in r.stdout


def test_a_data_session_needs_only_the_regen_jobs(tmp_path):
    """QUALITY_DATA_ONLY=1 (bench/runs/quality19k.env): every job after regen is not needed, so the run ends at
    regen."""
    script = f"""
        Q={tmp_path}; CODECS=(lossless); REGEN_MORE_FLAGS=(--samples 4 --first-sample 5); PY={sys.executable}
        is_done() {{ [ -f "$Q/done/$1" ]; }}
        cd {ROOT}; source bench/quality_jobs.sh; source bench/quality_home.sh
        for j in "${{JOBS[@]}}"; do not_needed "$j" && echo "$j skip" || echo "$j run"; done
    """
    got = lambda env: subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                                     env={**__import__("os").environ, **env}).stdout.split("\n")
    data = got({"QUALITY_DATA_ONLY": "1"})
    assert "regen run" in data and "regen-more run" in data
    assert {"extract-lossless skip", "extract-val skip", "train-lossless skip"} <= set(data)
    assert {"extract-lossless run", "train-lossless run"} <= set(got({"QUALITY_DATA_ONLY": ""}))


def _share(q: Path, src: Path) -> subprocess.CompletedProcess:
    """The driver's share_from_earlier_run, as setup calls it first (say / fail / finish stubbed)."""
    script = f"""
        say() {{ echo "$*"; }}; fail() {{ echo "FAIL: $*"; exit 1; }}; finish() {{ echo "FINISH $1"; exit "$1"; }}
        Q={q}; CARRY={q}/carry; REGEN_SOURCE=$CARRY/data/sharegpt_all_turns.jsonl
        export QUALITY_SHARE_FROM={src}
        mkdir -p "$Q"; cd {ROOT}; source bench/quality_home.sh
        share_from_earlier_run && echo "CARRY=$CARRY" && echo "SOURCE=$REGEN_SOURCE"
    """
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_second_run_shares_the_first_runs_carry_under_its_own_path(tmp_path):
    """QUALITY_SHARE_FROM (a data session after a training run on one warm machine): the first run's carry is read
    by its real path (regen's seed sidecars name their source file, and seed only from that path), its GGUF and
    model cache are linked, and nothing of the second run's own state goes into the first run's directory."""
    first, second = tmp_path / "quality", tmp_path / "quality2"
    (first / "carry" / "data").mkdir(parents=True)
    (first / "models").mkdir()
    (first / "smollm2.gguf").write_bytes(b"gguf")
    r = _share(second, first)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"CARRY={first.resolve()}/carry" in r.stdout
    assert f"SOURCE={first.resolve()}/carry/data/sharegpt_all_turns.jsonl" in r.stdout
    assert (second / "smollm2.gguf").read_bytes() == b"gguf" and (second / "models").resolve() == first / "models"
    assert not (second / "carry").exists() and sorted(p.name for p in first.iterdir()) == ["carry", "models",
                                                                                           "smollm2.gguf"]
    r = _share(first, first)   # its own directory
    assert r.returncode == 1 and "is this run's own QUALITY_DIR" in r.stdout
    r = _share(second, tmp_path / "fresh")   # a fresh machine: nothing stashed there
    assert r.returncode == 3 and "has no carry/" in r.stdout and "start again at call A" in r.stdout


def test_setup_refuses_a_regen_file_seeded_under_another_env(tmp_path):
    """A regen file seeded from one seed (recorded in seed.from) is not continued by a setup whose env names
    another seed: it stops with the two names. The same seed, or no seed file recorded, goes on."""
    q = tmp_path / "q"
    (q / "logs").mkdir(parents=True)
    (q / "regenerated.jsonl").write_text(_rows(["a#0"]))

    def setup(seed_name):
        script = f"""
            say() {{ echo "$*"; }}; fail() {{ echo "FAIL: $*"; exit 1; }}
            Q={q}; CARRY={q}/carry; PY={sys.executable}; HELDOUT=2; REGEN_MORE_FLAGS=(); REPO={ROOT}
            export QUALITY_REGEN_SEED={tmp_path}/{seed_name}
            cd {ROOT}; source bench/quality_home.sh
            seed_regenerated && echo SEEDED-OK
        """
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)

    assert "SEEDED-OK" in setup("first_turns.jsonl.gz").stdout            # nothing recorded: goes on
    (q / "seed.from").write_text("first_turns.jsonl.gz\n")
    assert "SEEDED-OK" in setup("first_turns.jsonl.gz").stdout
    r = setup("all_turns_greedy4.jsonl.xz")
    assert r.returncode == 1 and "seeded from first_turns.jsonl.gz" in r.stdout and "all_turns_greedy4" in r.stdout
    assert (q / "regenerated.jsonl").read_text() == _rows(["a#0"])          # untouched
