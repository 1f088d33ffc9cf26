"""scripts/drafters_aside.sh: drafters kept on main leave the working tree for the device calls (the tree plus a
call's carry must stay under 64 MiB) and come back whole; part paths under bench/drafters follow them."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sh(repo: Path, body: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -e; cd {repo}; source {ROOT}/scripts/drafters_aside.sh; {body}"],
                          capture_output=True, text=True, timeout=60)


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    part = repo / "bench" / "drafters" / "s23" / "drafter_lossless.tar.part-1-of-2"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\x00weights" * 100)
    (part.parent / "drafter_lossless.tar.part-2-of-2").write_bytes(b"rest")
    return repo


def test_aside_moves_the_drafters_out_rewrites_part_paths_and_restore_brings_them_back(tmp_path):
    repo = _repo(tmp_path)
    before = {p.relative_to(repo / "bench"): p.read_bytes() for p in (repo / "bench").rglob("*") if p.is_file()}
    r = _sh(repo, 'INIT_PARTS=bench/drafters/s23 DRAFTER_PARTS=/elsewhere/d OTHER=bench/drafters/s23; '
                  'drafters_aside INIT_PARTS DRAFTER_PARTS; echo "I=$INIT_PARTS D=$DRAFTER_PARTS O=$OTHER"; '
                  'ls $INIT_PARTS')
    assert r.returncode == 0, r.stderr
    assert "I=.drafters-aside/drafters/s23 D=/elsewhere/d O=bench/drafters/s23" in r.stdout   # only named vars
    assert "drafter_lossless.tar.part-1-of-2" in r.stdout                                     # readable there
    assert not (repo / "bench" / "drafters").exists()                                         # out of the tree
    r = _sh(repo, "drafters_restore")
    assert r.returncode == 0, r.stderr
    after = {p.relative_to(repo / "bench"): p.read_bytes() for p in (repo / "bench").rglob("*") if p.is_file()}
    assert after == before and not (repo / ".drafters-aside").exists()
    assert _sh(repo, "drafters_restore").returncode == 0                                      # nothing aside: no-op


def test_restore_refuses_when_both_copies_exist(tmp_path):
    repo = _repo(tmp_path)
    assert _sh(repo, "drafters_aside").returncode == 0
    (repo / "bench" / "drafters").mkdir()                       # e.g. a checkout put the folder back meanwhile
    r = _sh(repo, "drafters_restore")
    assert r.returncode == 1 and "both bench/drafters and .drafters-aside/drafters exist" in r.stderr
    assert (repo / ".drafters-aside" / "drafters" / "s23").is_dir()                           # nothing lost


def test_prepare_gpu_carry_moves_aside_every_parts_dir_it_reads():
    """Every VAR_PARTS that prepare_gpu_carry.sh packs into stash calls is rewritten to the aside copy (session 25:
    KERNEL_PARTS=bench/drafters/s25 was not, so its parts were looked for where they no longer were)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "scripts" / "prepare_gpu_carry.sh").read_text()
    read = set(re.findall(r"parts_calls (\w+_PARTS)", text))
    (aside_line,) = [ln for ln in text.splitlines() if ln.startswith("drafters_aside ")]
    assert read and read <= set(aside_line.split("#")[0].split()[1:])
