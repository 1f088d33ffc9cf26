"""`train --profile-steps`: a profiled window of a real (CPU) run writes its per-step split and op tables; the
spec is checked up front; a run that ends inside a window writes nothing for it."""

from __future__ import annotations

import json

import pytest

from dflash_pipe.errors import UsageError
from dflash_pipe.train.step_profile import parse_profile_steps
from tests.cache_helpers import write_train_cache


def test_profiled_steps_write_the_split_and_the_op_tables(tmp_path, capsys):
    from dflash_pipe.config import RunConfig, normalize
    from dflash_pipe.train.trainer import run_train

    cache = tmp_path / "cache"
    write_train_cache(cache, num_docs=12, seed=8)
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(tmp_path / "out")
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.max_steps = 96, 8, 6
    cfg.train.profile_steps = "1:3,5:9"           # the second window is still open when the run ends
    steps = run_train(normalize(cfg))["steps"]
    prof = tmp_path / "out" / "profile"
    assert sorted(p.name for p in prof.iterdir()) == ["steps_1-3.json", "steps_1-3.txt"]
    rec = json.loads((prof / "steps_1-3.json").read_text())
    assert rec["steps"] == [1, 3] and rec["wall_ms"] > 0 and 0 < rec["cpu_ms"] <= 3 * rec["wall_ms"]
    text = (prof / "steps_1-3.txt").read_text()
    assert "top ops by host time" in text and "aten::" in text   # the step's own ops, by name
    out = capsys.readouterr().out
    assert "train: profiled steps 1..3" in out
    # CPU time per thread, in the window and over the whole run (Linux /proc): the step loop's thread and the
    # loader's pools by name
    assert rec["threads_ms"]["MainThread"]["cpu"] > 0
    run = json.loads((tmp_path / "out" / "thread_times.json").read_text())
    assert run["steps"] == steps > 3 and run["wall_ms_per_step"] > 0
    assert run["threads_ms"]["MainThread"]["cpu"] > 0 and {"dflash-batch", "dflash-decode"} <= set(run["threads_ms"])
    assert run["device_wait_ms_per_step"] == 0          # the CPU step has no device to wait for
    assert f"train: threads over {steps} steps, wall " in out and "waiting for the device 0.0 of it" in out


@pytest.mark.parametrize("spec", ["5", "3:3", "4:8,6:9", "a:b", "-1:2"])
def test_a_bad_profile_spec_is_a_usage_error_naming_it(spec):
    from dflash_pipe.config import RunConfig, normalize

    cfg = RunConfig()
    cfg.train.profile_steps = spec
    with pytest.raises(UsageError, match="--profile-steps"):
        normalize(cfg)
    assert parse_profile_steps(" 0:2 , 10:12 ") == [(0, 2), (10, 12)]


def test_a_failing_profiler_turns_itself_off_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import torch

    from dflash_pipe.train.step_profile import StepProfiler

    def broken(*a, **k):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(torch.profiler, "profile", broken)
    prof = StepProfiler("1:2,4:5", tmp_path, True, torch.device("cpu"))
    for step in range(1, 7):
        prof.after_step(step)
        prof.before_next_step(step)
    assert prof.windows == [] and not (tmp_path / "profile").exists()
    assert capsys.readouterr().out.count("profiling off") == 1
