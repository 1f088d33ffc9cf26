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
