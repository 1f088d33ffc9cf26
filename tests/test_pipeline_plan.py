"""Orchestration: when stage 1 is skipped, resumed, rerun or refused (real embedded SmolLM2 target)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.config import load_manifest, normalize
from dflash_pipe.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "target": {"model": '"embedded:smollm2-135m-instruct"'},
    "data": {"source": '"embedded:sharegpt"', "max_samples": "3"},
    "extract": {"cache_dir": "{cache}", "max_length": "64", "token_budget": "128", "num_shards": "2", "topk": "4",
                "num_target_layers": "2"},
    "drafter": {"num_layers": "1", "block_size": "4"},
    "train": {"output_dir": "{out}", "epochs": "1", "context_tokens": "128", "num_anchors": "8",
              "max_anchors_per_doc": "8", "checkpoint_every": "0", "loader_workers": "1"},
}


def pipeline_env() -> dict:
    """run_pipeline.sh on this interpreter. DFLASH_ENV_CHECKED tells scripts/setup_env.sh that it imports torch,
    transformers and dflash_pipe (it is running them), which spares each run the 3-4 s import check."""
    return {**os.environ, "DFLASH_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
            "DFLASH_ENV_CHECKED": f"{sys.executable}:{ROOT}"}


def write_manifest(tmp: Path, name: str, cache: Path, out: Path, extra: str = "") -> Path:
    """The base manifest with "section.key = value" lines of `extra` replacing or adding keys."""
    tables = {sec: dict(kv) for sec, kv in BASE.items()}
    tables["extract"]["cache_dir"] = f'"{cache}"'
    tables["train"]["output_dir"] = f'"{out}"'
    for line in extra.splitlines():
        if line.strip():
            key, value = (x.strip() for x in line.split("=", 1))
            section, k = key.split(".")
            tables[section][k] = value
    path = tmp / name
    path.write_text("".join(f"[{sec}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for sec, kv in tables.items()))
    return path


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    from dflash_pipe.extract.pipeline import run_extract

    tmp = tmp_path_factory.mktemp("plan")
    cache, out = tmp / "cache", tmp / "out"
    m = write_manifest(tmp, "base.toml", cache, out)
    cfg = normalize(load_manifest(m))
    assert make_plan(cfg).stage1 == "run"
    assert run_extract(cfg).complete
    return tmp, cache, out, m


def _plan(path: Path):
    return make_plan(normalize(load_manifest(path)))


def test_complete_matching_cache_is_skipped(extracted):
    _, _, _, m = extracted
    plan = _plan(m)
    assert plan.stage1 == "skip" and plan.committed == 2


def test_drafter_or_training_changes_keep_the_cache(extracted):
    tmp, cache, out, m = extracted
    base = _plan(m).fingerprint
    changed = write_manifest(tmp, "drafter.toml", cache, out, "drafter.num_layers = 2\ndrafter.block_size = 8\n"
                                                              "train.lr = 0.0003\ntrain.num_anchors = 4")
    plan = _plan(changed)
    assert plan.stage1 == "skip" and plan.fingerprint == base


@pytest.mark.parametrize("extra,field", [("data.max_samples = 2", "dataset_fingerprint"),
                                         ("extract.topk = 8", "topk"),
                                         ("extract.max_length = 48", "max_length"),
                                         ("extract.codec = \"fp8\"", "codec")])
def test_target_data_or_extraction_changes_are_refused(extracted, extra, field):
    tmp, cache, out, _ = extracted
    plan = _plan(write_manifest(tmp, "changed.toml", cache, out, extra))
    assert plan.stage1 == "refuse" and set(plan.differing) == {field}


def test_a_changed_cache_with_overwrite_in_the_manifest_is_rerun_not_refused(extracted):
    """`[extract] overwrite = true` made extract delete the cache, yet plan (and so run_pipeline) refused it
    (session 28's review)."""
    tmp, cache, out, _ = extracted
    plan = _plan(write_manifest(tmp, "over.toml", cache, out, "extract.topk = 8\nextract.overwrite = true"))
    assert plan.stage1 == "run" and set(plan.differing) == {"topk"} and "overwrite = true" in plan.reason


def test_missing_shard_means_resume(extracted, tmp_path):
    import shutil

    _, cache, out, _ = extracted
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    (copy / "shard-00001-of-00002.json").unlink()
    plan = _plan(write_manifest(tmp_path, "r.toml", copy, out))
    assert plan.stage1 == "resume" and plan.committed == 1


def _damage_head(cache: Path) -> str:
    (cache / "target_head.safetensors").unlink()
    return "target_head.safetensors"


def _truncate_head(cache: Path) -> str:
    """A head file cut short (a killed copy, a full disk): its header parses, its data ends early."""
    path = cache / "target_head.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 16])
    return "target_head.safetensors"


def _head_with_bad_header(cache: Path) -> str:
    path = cache / "target_head.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"garbage!"
    path.write_bytes(bytes(data))
    return "target_head.safetensors"


def _truncate_manifest(cache: Path) -> str:
    text = (cache / "manifest.json").read_text()
    (cache / "manifest.json").write_text(text[:len(text) // 2])
    return "manifest.json"


def _manifest_without_totals(cache: Path) -> str:
    import json

    man = json.loads((cache / "manifest.json").read_text())
    del man["totals"]
    (cache / "manifest.json").write_text(json.dumps(man))
    return "manifest.json"


@pytest.mark.parametrize("damage", [_damage_head, _truncate_head, _head_with_bad_header, _truncate_manifest,
                                    _manifest_without_totals],
                         ids=["head file deleted", "head file truncated", "head file header garbled",
                              "manifest truncated", "manifest without totals"])
def test_a_complete_cache_missing_what_extract_rewrites_is_resumed_not_skipped(extracted, tmp_path, damage):
    """Train refuses such a cache (exit 3, 'rerun extract'): plan must not say SKIP, so run_pipeline.sh runs
    extract, which rewrites the head file / the manifest and keeps every committed shard. Until session 29 a head
    file that exists but is damaged (truncated, garbled header) was SKIP."""
    import shutil

    _, cache, out, _ = extracted
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    name = damage(copy)
    plan = _plan(write_manifest(tmp_path, "r.toml", copy, out))
    assert plan.stage1 == "resume" and plan.committed == 2
    assert name in plan.reason and "extract rewrites" in plan.reason
    assert "RESUME" in plan.describe()


@pytest.mark.parametrize("head_damage", [_damage_head, _truncate_head], ids=["head deleted", "head truncated"])
def test_extract_repairs_what_plan_said_it_would_and_plan_then_skips(extracted, tmp_path, head_damage):
    """Until session 29 extract rewrote only a missing head file: a truncated one stayed (plan said SKIP, train
    exit 3). Now extract rewrites a head that fails plan's check, and the repaired head loads."""
    import shutil

    from dflash_pipe.extract.pipeline import run_extract
    import torch

    from dflash_pipe.train.components import FrozenHead

    _, cache, out, _ = extracted
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    good = (cache / "target_head.safetensors").read_bytes()
    head_damage(copy)
    _truncate_manifest(copy)
    m = write_manifest(tmp_path, "r.toml", copy, out)
    assert _plan(m).stage1 == "resume"
    summary = run_extract(normalize(load_manifest(m)))
    assert summary.shards_done == [] and summary.complete and (copy / "target_head.safetensors").exists()
    assert len((copy / "target_head.safetensors").read_bytes()) == len(good)  # whole again
    assert _plan(m).stage1 == "skip"
    FrozenHead(copy, "target_head.safetensors", torch.device("cpu"), torch.float32)  # train's load: no exit 3


@pytest.mark.slow
def test_run_pipeline_skips_stage1_trains_and_refuses_mixing(extracted):
    tmp, cache, out, m = extracted
    env = pipeline_env()
    env.pop("EXTRACT_GPUS", None)
    env.pop("TRAIN_GPUS", None)
    dry = subprocess.run([str(ROOT / "run_pipeline.sh"), str(m), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "stage 1: skip" in dry.stdout and "SKIP" in dry.stdout
    run = subprocess.run([str(ROOT / "run_pipeline.sh"), str(m), "--no-eval"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stage 1 skipped" in run.stdout and (out / "export" / "model.safetensors").exists()
    bad = write_manifest(tmp, "bad.toml", cache, out, "extract.topk = 8")
    refused = subprocess.run([str(ROOT / "run_pipeline.sh"), str(bad), "--no-eval"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 3
    assert "refusing to mix caches" in refused.stderr and "topk" in refused.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_pipeline_with_130_and_a_rerun_resumes(tmp_path):
    from tests.proc_helpers import interrupt_after_first_shard

    cache, out = tmp_path / "cache", tmp_path / "out"
    m = write_manifest(tmp_path, "int.toml", cache, out, "data.max_samples = 24\nextract.num_shards = 4")
    env = pipeline_env()
    interrupt_after_first_shard([str(ROOT / "run_pipeline.sh"), str(m), "--no-eval"], env, cache, "the pipeline")
    assert not [p for p in os.listdir(cache) if p.startswith(".")]
    again = subprocess.run([str(ROOT / "run_pipeline.sh"), str(m), "--no-eval"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (cache / "manifest.json").exists() and (out / "export" / "config.json").exists()


def test_missing_model_dir_is_a_usage_error_naming_the_flag(tmp_path):
    """A model path that does not exist is refused before transformers is asked (it would try the hub)."""
    from dflash_pipe.errors import UsageError

    missing = tmp_path / "no-such-model"
    m = write_manifest(tmp_path, "m.toml", tmp_path / "cache", tmp_path / "out", f'target.model = "{missing}"')
    with pytest.raises(UsageError, match="--target-model.*not a local directory"):
        _plan(m)


def test_a_consumed_window_cache_is_not_complete_plan_says_so_and_extract_redoes_it(extracted, tmp_path, capsys):
    import json
    import shutil

    from dflash_pipe.cache import load_spec
    from dflash_pipe.cache.window import Ledger, save_ledger
    from dflash_pipe.cli import main
    from dflash_pipe.extract.pipeline import run_extract

    _, cache, _, _ = extracted
    live = tmp_path / "cache"
    shutil.copytree(cache, live)
    m = write_manifest(tmp_path, "win.toml", live, tmp_path / "out",
                       "extract.max_cache_gib = 2.5\ntrain.passes_per_shard = 2")
    spec = load_spec(live)
    led = Ledger(spec["fingerprint"], 2, str(tmp_path / "out"))
    led.add(1, 1)
    led.add(0, 1)
    led.retire(0, 1)
    led.shards[0].state = "deleted"  # shard 1 (commit #0) consumed by a window run still in progress
    save_ledger(live, led)
    (live / "shard-00001-of-00002.parquet").unlink()
    plan = _plan(m)
    assert plan.stage1 == "resume" and "is streaming this cache" in plan.reason
    text = plan.describe()
    assert "reads every shard 2 times in 3 rounds" in text and "budget 2.5 GiB" in text and "high-water" in text
    assert plan.window["passes_per_shard"] == 2 and plan.window["shard_bytes_max"] > 0
    main(["cache", "info", str(live)])
    info = json.loads(capsys.readouterr().out)
    assert info["window"]["deleted"] == [1] and info["window"]["retired"] == [] and info["window"]["held"] == [0]
    assert info["window"]["pending"] == [] and info["window"]["shard_files_on_disk"] == 1
    assert run_extract(normalize(load_manifest(m))).shards_done == []  # in progress: consumed is committed

    led.finished = True
    save_ledger(live, led)
    plan = _plan(m)
    assert plan.stage1 == "run" and "consumed 1 of 2 shards" in plan.reason
    summary = run_extract(normalize(load_manifest(m)))  # the next drafter run re-extracts exactly those
    assert summary.shards_done == [1] and summary.complete and not (live / "window.json").exists()
    assert _plan(m).stage1 == "skip"


CPU_REFUSAL = "# run_pipeline.sh: not"   # a shipped manifest that run_pipeline.sh cannot run on a CPU says why


@pytest.mark.parametrize("manifest", sorted((ROOT / "manifests").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_manifest_is_consistent_and_the_cpu_ones_plan(manifest, tmp_path):
    cfg = normalize(load_manifest(manifest))  # cross-field rules (e.g. 'heldout' needs skip_samples) hold
    if CPU_REFUSAL in manifest.read_text():
        return  # its header says why (GPU sizes, data made by another command first)
    cfg.extract.cache_dir, cfg.train.output_dir = str(tmp_path / "cache"), str(tmp_path / "train")
    cfg.extract.device = "cpu"
    plan = make_plan(cfg)
    assert plan.stage1 == "run" and plan.device == "cpu" and "[CPU]" in plan.describe()


def test_heldout_prompts_without_held_out_data_are_refused_before_any_stage(tmp_path):
    from dflash_pipe.errors import UsageError

    m = write_manifest(tmp_path, "m.toml", tmp_path / "cache", tmp_path / "out")
    m.write_text(m.read_text() + '[eval]\nprompts = "mtbench,heldout"\n')
    with pytest.raises(UsageError, match="heldout.*--data-skip-samples") as err:
        _plan(m)
    assert err.value.exit_code == 2
