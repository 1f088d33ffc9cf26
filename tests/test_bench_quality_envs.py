"""Every bench/runs/quality19*.env's QUALITY_TRAIN_FLAGS parse as `dflash-pipe train` flags on the GPU manifest (the
driver passes them after its own, bench/quality_jobs.sh), and the grouped-attention env sets what its header says."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
ENVS = sorted((ROOT / "bench" / "runs").glob("quality19*.env"))


def train_flags(env: Path, extra: str = "") -> list[str]:
    out = subprocess.run(["bash", "-c", f'{extra} source "{env}" >/dev/null; printf %s "${{QUALITY_TRAIN_FLAGS:-}}"'],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return shlex.split(out.stdout)


def parsed(monkeypatch, flags: list[str]):
    import dflash_pipe.train.trainer as trainer
    from dflash_pipe.cli import app

    seen = {}
    monkeypatch.setattr(trainer, "run_train", lambda cfg: seen.setdefault("cfg", cfg))
    res = CliRunner().invoke(app, ["train", "-m", str(ROOT / "manifests/quality-smollm2-gpu.toml"),
                                   "--cache-dir", "/tmp/x", "--output-dir", "/tmp/y", *flags])
    assert res.exit_code == 0, res.output
    return seen["cfg"]


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_train_flags_parse(monkeypatch, env):
    parsed(monkeypatch, train_flags(env))


def test_grouped_env_doubles_the_anchors_on_the_grouped_path(monkeypatch):
    cfg = parsed(monkeypatch, train_flags(ROOT / "bench/runs/quality19n.env"))
    assert (cfg.train.num_anchors, cfg.train.max_anchors_per_doc, cfg.drafter.attention) == (1024, 512, "sdpa-grouped")
    assert cfg.train.context_tokens == 8192 and cfg.train.seed == 2 and cfg.train.init_from.endswith("init/lossless")
    cfg = parsed(monkeypatch, train_flags(ROOT / "bench/runs/quality19n.env", "QUALITY_ANCHORS=2048"))
    assert cfg.train.num_anchors == 2048


def _job_list(tmp_path, env: dict) -> list[str]:
    out = subprocess.run(["bash", "bench/quality_gpu.sh", "status"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=True,
                         env={**__import__("os").environ, "QUALITY_DIR": str(tmp_path / "q"),
                              "OUT": str(tmp_path / "out"), **env})
    return [ln.split()[1].rstrip(":") for ln in out.stdout.splitlines() if ln.startswith(("pending", "done"))]


def test_a_training_only_run_has_no_eval_jobs(tmp_path):
    """QUALITY_EVAL_SETS="" (bench/runs/quality19q.env): the run ends when its drafter is trained (and sent home)."""
    everything = _job_list(tmp_path, {})
    assert [j for j in everything if j.startswith("eval-")] == ["eval-mtbench", "eval-humaneval", "eval-heldout"]
    for name, passes in (("quality19q", "1"), ("quality19r", "2")):   # one pass / two passes, training only
        got = subprocess.run(["bash", "-c", f'source "{ROOT}/bench/runs/{name}.env"; '
                              'printf "%s|%s" "${QUALITY_EVAL_SETS-unset}" "$QUALITY_PASSES"'],
                             capture_output=True, text=True, check=True).stdout
        assert got == f"|{passes}", name
    env = ""
    only = _job_list(tmp_path, {"QUALITY_EVAL_SETS": env})
    assert only == [j for j in everything if not j.startswith("eval-")] and "train-lossless" in only


def test_quality19v_runs_two_passes_unless_the_caller_asks_for_one():
    """Its fallback is `QUALITY_PASSES=1` in front of the B command; the env it sources sets 1 itself."""
    def passes(extra: str) -> str:
        cmd = f'{extra} source bench/runs/quality19v.env >/dev/null; printf %s "$QUALITY_PASSES"'
        return subprocess.run(["bash", "-c", cmd],
                              capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert (passes(""), passes("export QUALITY_PASSES=1;")) == ("2", "1")


def test_every_seed_file_an_env_names_is_in_the_repository():
    """The envs moved to bench/runs/ (session 35): the data files they name by a path of their own resolve."""
    named = {}
    for env in ENVS:
        out = subprocess.run(["bash", "-c", f'source "{env}" >/dev/null; printf "%s\\n" "${{QUALITY_REGEN_SEED:-}}" '
                              '"${QUALITY_REGEN_MORE_SEED:-}"'], capture_output=True, text=True, check=True, cwd="/")
        for path in filter(None, out.stdout.splitlines()):
            named[path] = env.name
    assert named, "no env names a seed file"
    for path, env in named.items():
        assert Path(path).is_file() and Path(path).parent == ROOT / "bench" / "data", (env, path)
