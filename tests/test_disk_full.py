"""Disk full (ENOSPC) at every write the project makes: exit-4 error naming the path, nothing partial
left, the same call afterwards succeeds. The write sites are listed in RELIABILITY.md ("Write sites").

Injected here (cheap, runs anywhere); test_disk_full_tmpfs.py repeats the important ones on a real,
full filesystem.
  * durable files (temp + fsync + rename): os.fsync raises ENOSPC, so the write itself went through
    and only the commit fails -- the temp file must go, the old file (if any) must stay;
  * safetensors files: safetensors' own error (`SafetensorError ... (os error 28)`) from save_file;
  * appended logs: the first os.write writes half the bytes, the next raises ENOSPC -- the file
    must be cut back to its old length;
  * nice-to-have outputs (PNG plots, TensorBoard): a warning, the run goes on, no partial file.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_pipe.errors import RuntimeFailure

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _no_temps(d: Path) -> list[str]:
    return [str(p) for p in Path(d).rglob("*") if p.name.startswith(".") and ".tmp-" in p.name]


def fail_fsync(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", fsync)


def fail_safetensors(monkeypatch, module):
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")  # what a cut write leaves behind
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(module, "save_file", save_file)


def fail_second_write(monkeypatch):
    real = os.write
    calls = [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] == 1:
            return real(fd, bytes(data)[:max(1, len(data) // 2)])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", write)


# --------------------------------------------------------------------------- the write sites

@functools.lru_cache(maxsize=1)
def tiny_bundle():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    return SimpleNamespace(model=LlamaForCausalLM(cfg), config=cfg, hidden_size=16, vocab_size=64, num_layers=1,
                           identity={"model": "tiny", "weights_fingerprint": "x"})


def _spec():
    from dflash_pipe.cache import make_spec

    return make_spec({"t": 1}, {}, {"head_file": "target_head.safetensors"}, 1, {})


def site_head_file(d: Path):
    from dflash_pipe.target.heads import save_embeddings_and_head

    save_embeddings_and_head(tiny_bundle(), d / "target_head.safetensors")
    return d / "target_head.safetensors"


def site_cache_spec(d: Path):
    from dflash_pipe.cache import init_or_check_spec

    init_or_check_spec(d, _spec())
    return d / "cache_spec.json"


def site_sidecar(d: Path):
    from dflash_pipe.cache import ShardInfo, write_sidecar

    write_sidecar(d, _spec(), ShardInfo("shard-00000-of-00001.parquet", 0, 1, 2, 1, 10, "ab", 1, 8), {})
    return d / "shard-00000-of-00001.json"


def site_manifest(d: Path):
    from dflash_pipe.cache import try_finalize
    from tests.cache_helpers import make_docs, write_cache

    if not (d / "cache_spec.json").exists():
        write_cache(d, make_docs(3, 8), 8, 2, num_shards=1, finalize=False)
    from dflash_pipe.cache import load_spec
    assert try_finalize(d, load_spec(d)) is not None
    return d / "manifest.json"


def site_shard(d: Path):
    from dflash_pipe.cache import encode_hidden, shard_name
    from dflash_pipe.cache.schema import shard_meta
    from dflash_pipe.cache.writer import ShardWriter, make_row
    from tests.cache_helpers import make_docs

    w = ShardWriter(d, shard_name(0, 1), 0, "lossless", 4, shard_meta("lossless", 4, 8, 2, "f"), 2000)
    for doc in make_docs(3, 8):
        w.add(make_row(doc["sample_id"], doc["doc_index"], doc["input_ids"], doc["loss_mask"],
                       encode_hidden(doc["hidden"], "lossless", 2), doc["topk_ids"], doc["topk_logprobs"]))
    w.commit()
    return d / shard_name(0, 1)


def site_resolved_config(d: Path):
    from dflash_pipe.config import RunConfig, write_resolved

    return write_resolved(RunConfig(), d)


def _drafter():
    from dflash_pipe.drafter.model import DFlashDrafter
    from tests.test_drafter_support import tiny_config

    cfg = tiny_config(num_layers=1)
    torch.manual_seed(0)
    return DFlashDrafter(cfg), cfg


def site_checkpoint(d: Path):
    from dflash_pipe.train.checkpoint import save_checkpoint
    from dflash_pipe.train.master_weights import MasterWeights

    model, _ = _drafter()
    weights = MasterWeights(model)
    opt = torch.optim.AdamW(weights.masters, lr=1e-3)
    save_checkpoint(d, 2, weights, opt, {"step": 2})
    return d / "ckpt-00000002"


def site_export(d: Path):
    from dflash_pipe.drafter.export import export_drafter

    model, cfg = _drafter()
    return export_drafter(model, cfg, d / "export") / "model.safetensors"


def site_eval_report(d: Path):
    from dflash_pipe.config import RunConfig
    from dflash_pipe.eval.runner import _write

    _write({"sets": {}}, [{"id": "p0"}], d, RunConfig())
    return d / "eval_report.json"


def site_eval_progress(d: Path):
    from dflash_pipe.eval.progress_log import EvalProgress

    EvalProgress(d, "k").add("heldout", "p0", [7], [1, 2], 0.1, {})
    return d / "eval_progress.jsonl"


def site_regenerate_output(d: Path):
    from dflash_pipe.eval.regenerate import JsonlAppender

    JsonlAppender(d / "regen.jsonl").append([{"id": "a", "messages": []}, {"id": "b", "messages": []}])
    return d / "regen.jsonl"


def _logger(d: Path, tensorboard: bool = False):
    from dflash_pipe.train.metrics import StepLogger

    return StepLogger(d, 10, True, torch.device("cpu"), 1.0, tensorboard=tensorboard)


METRICS = {"loss": 1.0, "acc": 0.5, "tau": 1.5, "acc_0": 0.5}


def site_metrics(d: Path):
    _logger(d).log(0, 0, METRICS, 0.1, 0.0, 10, 1e-3, 1.0)
    return d / "metrics.jsonl"


def site_val_metrics(d: Path):
    _logger(d).log_validation(0, {"val_loss": 1.0, "val_acc": 0.5, "val_tau": 1.2})
    return d / "val_metrics.jsonl"


def site_window_ledger(d: Path):
    from dflash_pipe.cache.window import Ledger, ledger_path, save_ledger

    save_ledger(d, Ledger("f" * 64, 2, "runs/x/train"))
    return ledger_path(d)


def site_history_truncation(d: Path):
    path = d / "metrics.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"step": s, **METRICS}) + "\n" for s in range(4)))
    _logger(d).truncate_history(1)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [0, 1]
    return path


# (name, site, the path the error must name) -- every durable site gets the fsync fault; the
# safetensors sites also the writer's own error; the appended logs the half-written line.
DURABLE = [("head file", site_head_file, "target_head.safetensors"),
           ("cache spec", site_cache_spec, "cache_spec.json"),
           ("shard sidecar", site_sidecar, "shard-00000-of-00001.json"),
           ("manifest", site_manifest, "manifest.json"),
           ("shard", site_shard, "shard-00000-of-00001.parquet"),
           ("resolved config", site_resolved_config, "resolved_config.toml"),
           ("checkpoint", site_checkpoint, "ckpt-00000002"),
           ("export", site_export, "export/model.safetensors"),
           ("eval report", site_eval_report, "eval_report.json"),
           ("eval progress", site_eval_progress, "eval_progress.jsonl"),
           ("regenerate output", site_regenerate_output, "regen.jsonl"),
           ("history truncation", site_history_truncation, "metrics.jsonl"),
           ("window ledger", site_window_ledger, "window.json")]
SAFETENSORS = [("head file", site_head_file, "safetensors.torch", "target_head.safetensors"),  # imported in the call
               ("checkpoint", site_checkpoint, "dflash_pipe.train.checkpoint", "ckpt-00000002"),
               ("export", site_export, "dflash_pipe.drafter.export", "export/model.safetensors")]
APPENDS = [("metrics.jsonl", site_metrics), ("val_metrics.jsonl", site_val_metrics),
           ("eval progress", site_eval_progress), ("regenerate output", site_regenerate_output)]


def _assert_clean_failure(err, path: Path, d: Path):
    assert isinstance(err, RuntimeFailure) and err.exit_code == 4
    assert "disk full" in str(err) and str(path) in str(err) and "rerun" in str(err), str(err)
    assert not _no_temps(d), _no_temps(d)


@pytest.mark.parametrize("name,site,rel", DURABLE, ids=[n for n, _, _ in DURABLE])
def test_enospc_on_fsync_at_every_durable_write_site(tmp_path, monkeypatch, name, site, rel):
    d = tmp_path / "out"
    d.mkdir()
    if name == "manifest":  # a cache whose shards are committed, no manifest yet
        from tests.cache_helpers import make_docs, write_cache
        write_cache(d, make_docs(3, 8), 8, 2, num_shards=1, finalize=False)
    if name == "history truncation":
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **METRICS}) + "\n" for s in range(4)))
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    with monkeypatch.context() as m:
        fail_fsync(m)
        with pytest.raises(RuntimeFailure) as err:
            site(d)
    _assert_clean_failure(err.value, d / rel, d)
    after = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    # a failed write changes nothing visible (a first append leaves at most an empty file)
    assert {k: v for k, v in after.items() if v} == {k: v for k, v in before.items() if v}
    assert not (d / rel).exists() or name in ("history truncation", "eval progress", "regenerate output")
    assert Path(site(d)).exists()  # space is back: the same call succeeds


@pytest.mark.parametrize("name,site,module,rel", SAFETENSORS, ids=[n for n, _, _, _ in SAFETENSORS])
def test_safetensors_disk_full_is_exit_4_naming_the_path(tmp_path, monkeypatch, name, site, module, rel):
    import importlib

    d = tmp_path / "out"
    d.mkdir()
    with monkeypatch.context() as m:
        fail_safetensors(m, importlib.import_module(module))
        with pytest.raises(RuntimeFailure) as err:
            site(d)
    _assert_clean_failure(err.value, d / rel, d)
    assert not (d / rel).exists()
    assert Path(site(d)).exists()


@pytest.mark.parametrize("name,site", APPENDS, ids=[n for n, _ in APPENDS])
def test_half_written_log_line_is_cut_back(tmp_path, monkeypatch, name, site):
    d = tmp_path / "out"
    d.mkdir()
    site(d)  # one complete record first
    path = site(d)
    good = path.read_bytes()
    with monkeypatch.context() as m:
        fail_second_write(m)
        with pytest.raises(RuntimeFailure) as err:
            site(d)
    _assert_clean_failure(err.value, path, d)
    assert path.read_bytes() == good  # the half line was cut back
    site(d)
    assert path.read_bytes().startswith(good) and path.read_bytes().endswith(b"\n")


def test_plots_warn_and_leave_no_partial_file(tmp_path, monkeypatch, caplog):
    from dflash_pipe.eval.report import plot_acceptance
    from dflash_pipe.train.metrics import plot_history

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **METRICS}) + "\n" for s in range(3)))
    report = {"sets": {"heldout": {"prompts": 1, "target_only": {}, "dflash": {"acceptance": [1.0, 0.5], "tau": 1.5}}}}
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        fail_fsync(m)
        assert plot_history(tmp_path / "metrics.jsonl", tmp_path / "training.png") is None
        assert plot_acceptance(report, tmp_path / "acceptance.png") is None
    assert "training plot not written: disk full" in caplog.text and "acceptance plot not written" in caplog.text
    assert not (tmp_path / "training.png").exists() and not (tmp_path / "acceptance.png").exists()
    assert not _no_temps(tmp_path)
    assert plot_history(tmp_path / "metrics.jsonl", tmp_path / "training.png") == tmp_path / "training.png"


def test_tensorboard_failure_warns_once_and_training_logs_go_on(tmp_path, caplog):
    logger = _logger(tmp_path)
    calls = []

    class FullDiskWriter:
        def add_scalar(self, *a):
            calls.append(a)
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    logger.tb = FullDiskWriter()
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            logger.log(step, 0, METRICS, 0.1, 0.0, 10, 1e-3, 1.0)
        logger.close()
    assert len(calls) == 1 and logger.tb is None
    assert caplog.text.count("continuing without TensorBoard") == 1
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_embedded_conversion_disk_full_removes_its_temp_dir(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import transformers
    from dflash_pipe.target import embedded

    class Tok:
        def save_pretrained(self, d):
            Path(d, "tokenizer.json").write_text("{}")

    def dequantize(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"cut")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: Tok())
    monkeypatch.setattr(embedded, "_write_dequantized_model", dequantize)
    with pytest.raises(RuntimeFailure) as err:
        embedded.ensure_embedded_model_dir("smollm2-135m-instruct", tmp_path)
    assert err.value.exit_code == 4 and "disk full" in str(err.value)
    assert str(tmp_path / "smollm2-135m-instruct") in str(err.value) and "--model-cache-dir" in str(err.value)
    assert os.listdir(tmp_path) == []


def test_every_listed_write_site_is_covered():
    """The inventory in RELIABILITY.md and the sites tested here are the same list."""
    table = (Path(__file__).resolve().parents[1] / "RELIABILITY.md").read_text()
    section = table.split("## Write sites", 1)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    covered = {n for n, _, _ in DURABLE} | {n for n, _, _, _ in SAFETENSORS} | {n for n, _ in APPENDS} | {
        "training plot", "acceptance plot", "tensorboard", "embedded conversion"}
    named = {ln.split("|")[2].strip() for ln in rows}
    assert named == covered, (named ^ covered)
    assert len(rows) == len(covered) == 19


def test_an_unwritable_output_path_is_exit_4_naming_it_not_a_traceback(tmp_path, capsys):
    from dflash_pipe.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as ex:
        main(["train", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(blocker / "out")])
    err = capsys.readouterr().err
    assert ex.value.code == 4 and str(blocker) in err and "Traceback" not in err


def test_verify_of_a_directory_that_is_no_cache_says_so(tmp_path):
    from dflash_pipe.cache import verify_cache
    from dflash_pipe.errors import CacheError

    with pytest.raises(CacheError, match="not a dflash-pipe cache"):
        verify_cache(tmp_path)
