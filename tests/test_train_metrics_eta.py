"""The step log's ETA counts wall time between logged steps (validation, checkpoints), not only the steps'."""

import json

import torch

from dflash_pipe.train import metrics
from dflash_pipe.train.metrics import StepLogger


def test_eta_counts_the_time_between_steps_and_records_carry_it(tmp_path, monkeypatch, capsys):
    clock = iter(float(t) for t in range(1000, 2000))   # one wall second per logged step
    monkeypatch.setattr(metrics.time, "time", lambda: next(clock))
    log = StepLogger(tmp_path, 100, True, torch.device("cpu"), 1.0, tensorboard=False)
    m = {"loss": 1.0, "acc": 0.5, "tau": 1.5}
    for step in range(10):   # each step's own time is 0.01 s: the step time alone would say ETA ~1 s
        log.log(step, 0, m, 0.01, 0.0, 10, 1e-3, 1.0)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("ETA 1m30s"), last   # 90 steps left at 1 s each
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["time"] for r in recs] == [1000.0 + i for i in range(10)]


def test_step_records_count_the_real_anchors_and_show_a_binding_per_document_cap(tmp_path):
    """metrics.jsonl's `anchors`: the step's non-padding blocks. With one anchor per document the rows hold fewer
    real blocks than --num-anchors; with the cap lifted every step fills them."""
    from dflash_pipe.train.trainer import run_train
    from tests.cache_helpers import write_train_cache
    from tests.test_train_validation import _cfg

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=16, seed=2)
    got = {}
    for cap in (1, 64):
        cfg = _cfg(tmp_path, cache, tmp_path / f"cap{cap}")
        cfg.train.num_anchors, cfg.train.max_anchors_per_doc = 8, cap
        run_train(cfg)
        got[cap] = [json.loads(ln)["anchors"] for ln in (tmp_path / f"cap{cap}" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < a < 8 for a in got[1]), got[1]        # 96-token rows of 8-48-token documents: at most a few
    assert all(a == 8 for a in got[64]), got[64]
