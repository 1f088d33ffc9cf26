"""The trainer's per-step host work: the block embeddings (anchor rows gathered on the host, the blocks put together
on the device) against a row-by-row reference, and the step profiler's windows, which start after a step's
validation and checkpoint and name any such work that lands inside them. The pinned copies these exist for are
checked on the GPU (tests/test_train_host_copies_gpu.py)."""

from __future__ import annotations

import json

import torch

from dflash_pipe.train.components import FrozenHead
from dflash_pipe.train.step_profile import StepProfiler
from tests.cache_helpers import write_train_cache


def _head(tmp_path, device="cpu"):
    cache = tmp_path / "cache"
    if not cache.exists():
        write_train_cache(cache, num_docs=4, hidden=32, seed=3)
    return FrozenHead(cache, "target_head.safetensors", torch.device(device), torch.float32)


def test_block_embeds_are_each_anchor_row_then_mask_rows(tmp_path):
    head = _head(tmp_path)
    tokens = torch.tensor([5, 0, 96, 5, 17])
    B, mask_id = 4, 3
    for dtype in (torch.float32, torch.bfloat16):
        got = head.block_embeds(tokens, mask_id, B, dtype)
        assert got.shape == (len(tokens) * B, head.embed_VH.shape[1]) and got.dtype == dtype
        for n, tok in enumerate(tokens.tolist()):      # row by row from the table
            assert torch.equal(got[n * B], head.embed_VH[tok].to(dtype))
            for j in range(1, B):
                assert torch.equal(got[n * B + j], head.embed_VH[mask_id].to(dtype))
    assert list(head._mask_rows) == [mask_id]          # the MASK row is kept, not gathered again each step


def test_profile_windows_start_after_a_steps_validation_and_name_what_lands_inside(tmp_path):
    prof = StepProfiler("0:2,2:4,6:8", tmp_path, True, torch.device("cpu"))
    prof.before_next_step(0)                            # before the first step: the window from step 0 starts
    for step in range(1, 9):
        torch.ones(64).sum()                            # the step
        prof.after_step(step)
        if step % 2 == 0:                               # validation after every 2nd step (--val-every 2)
            torch.ones(8).sum()
            prof.note(f"validation after step {step}")
        prof.before_next_step(step)
    recs = {p.name: json.loads(p.read_text()) for p in (tmp_path / "profile").glob("*.json")}
    assert sorted(recs) == ["steps_0-2.json", "steps_2-4.json", "steps_6-8.json"]
    # a window ending at a validation step stops before it, one starting there starts after it
    assert recs["steps_0-2.json"]["inside"] == [] and recs["steps_2-4.json"]["inside"] == []
    assert recs["steps_6-8.json"]["inside"] == []

    prof = StepProfiler("1:5", tmp_path / "b", True, torch.device("cpu"))
    for step in range(1, 6):
        prof.after_step(step)
        if step in (2, 4):
            prof.note(f"checkpoint after step {step}")
        prof.before_next_step(step)
    rec = json.loads((tmp_path / "b" / "profile" / "steps_1-5.json").read_text())
    assert rec["inside"] == ["checkpoint after step 2", "checkpoint after step 4"]
    assert "inside the window: checkpoint after step 2, checkpoint after step 4" in \
        (tmp_path / "b" / "profile" / "steps_1-5.txt").read_text().splitlines()[0]


def test_a_resumed_run_skips_the_windows_it_started_past(tmp_path):
    prof = StepProfiler("2:4,10:12", tmp_path, True, torch.device("cpu"))
    prof.before_next_step(7)                            # resumed at step 7
    assert prof.windows == [(10, 12)]
    for step in range(8, 13):
        prof.after_step(step)
        prof.before_next_step(step)
    assert [p.name for p in (tmp_path / "profile").glob("*.json")] == ["steps_10-12.json"]


def test_thread_times_group_pools_and_count_new_threads_from_zero():
    import threading
    import time

    from dflash_pipe.train import thread_times

    assert thread_times.group_name("dflash-decode_3") == "dflash-decode"
    assert thread_times.group_name("MainThread") == "MainThread"
    before = thread_times.snapshot()
    assert before and all(isinstance(v[1], int) for v in before.values())
    done = threading.Event()

    def spin():   # ~50 ms on a CPU in a thread born inside the window
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:
            pass
        done.wait()

    t = threading.Thread(target=spin, name="spinner_0")
    t.start()
    time.sleep(0.2)
    after = thread_times.snapshot()
    done.set()
    t.join()
    rows = thread_times.per_step_ms(before, after, steps=10)
    assert 4.0 <= rows["spinner"]["cpu"] <= 15.0          # ~50 ms over 10 steps, counted from 0


def test_without_proc_the_thread_report_is_left_out(tmp_path, monkeypatch):
    """Not Linux (no /proc/self/task): no snapshot, no thread_times.json, no log line; training is unaffected."""
    from dflash_pipe.train import thread_times

    monkeypatch.setattr(thread_times, "_TASKS", tmp_path / "no-proc")
    assert thread_times.snapshot() == {}
    assert thread_times.report_run(tmp_path, thread_times.snapshot(), steps=5, wall_s=1.0, device_wait_s=0.0) is None
    assert not (tmp_path / "thread_times.json").exists()
