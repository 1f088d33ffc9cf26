"""SIGTERM sent to `extract` / `eval` / `regenerate` stops them as Ctrl-C does (KeyboardInterrupt: clean stop, exit 130)
instead of ending the process by the signal (dflash_pipe/interrupts.py; train has its own, train/graceful.py).
The end-to-end check for extract is tests/test_extract_e2e.py::test_ctrl_c_exits_130_and_leaves_a_resumable_cache."""

import os
import signal
import threading

import pytest

from dflash_pipe.interrupts import sigterm_as_interrupt


def test_sigterm_raises_keyboard_interrupt_inside_and_the_old_handler_is_back_after():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the SIGTERM to this process would find no handler off the main thread")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_ignored_sigterm_stays_ignored_and_nothing_is_installed_off_the_main_thread():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal.signal works on the main thread only")
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited ignored: left so, as Python does for SIGINT
    try:
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    seen = []

    def worker():
        with sigterm_as_interrupt():  # signal.signal would raise ValueError here
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [previous]


def _sigterm_once(proc, ready, what: str) -> str:
    """SIGTERM to the forked CLI run `proc` once `ready()` holds; asserts exit 130 (skips the test if it finished
    first); its stderr."""
    import time

    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline and not ready():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = proc.output()[1]
    if proc.returncode == 0:
        pytest.skip(f"{what} finished before SIGTERM landed")
    assert proc.returncode == 130, f"exit {proc.returncode}: {err[-2000:]}"
    return err


@pytest.mark.slow
def test_sigterm_stops_eval_with_130_and_a_rerun_resumes_from_its_progress_log(tmp_path):
    """`eval` gets SIGTERM after its first generation is logged: exit 130, the progress log kept, and the rerun
    resumes from it (that a resumed report equals an uninterrupted one: test_eval_runner.py)."""
    from pathlib import Path

    from dflash_pipe.eval.progress_log import PROGRESS_FILE
    from dflash_pipe.drafter.export import export_drafter
    from tests.eval_helpers import tiny_drafter
    from tests.fork_cli import run_cli, start_cli

    root = Path(__file__).resolve().parents[1]
    drafter, dcfg = tiny_drafter(block_size=4)
    export_drafter(drafter, dcfg, tmp_path / "train" / "export")
    out = tmp_path / "eval"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    argv = ["eval", "--target-model", "random:tiny-llama", "--device", "cpu", "--prompts", "mtbench,humaneval",
            "--max-prompts", "6", "--mtbench-turns", "1", "--max-new-tokens", "32",
            "--train-output-dir", str(tmp_path / "train"), "--output-dir", str(out)]
    progress = out / PROGRESS_FILE
    err = _sigterm_once(start_cli(argv, env), lambda: progress.exists() and progress.read_text(), "eval")
    assert "interrupted" in err
    done = len(progress.read_text().splitlines())
    assert done >= 1
    rerun = run_cli(argv, env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"eval: resuming, {done} generations already done" in rerun.stdout
    assert (out / "eval_report.json").exists() and not progress.exists()


@pytest.mark.slow
def test_sigterm_stops_regenerate_with_130_and_a_rerun_completes_every_conversation_once(tmp_path):
    """`regenerate` gets SIGTERM once its first rows are written: exit 130, the rows kept, and the rerun continues
    to every conversation exactly once."""
    import json
    from pathlib import Path

    from tests.fork_cli import run_cli, start_cli

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}?"},
                                                                   {"role": "assistant", "content": "-"}]}) + "\n"
                           for i in range(40)))
    out = tmp_path / "regen.jsonl"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    argv = ["regenerate", "--target-model", "random:tiny-llama", "--device", "cpu", "--source", str(src),
            "--output", str(out), "--max-new-tokens", "24", "--batch-size", "2"]
    _sigterm_once(start_cli(argv, env), lambda: out.exists() and out.read_text().strip(), "regenerate")
    kept = len(out.read_text().splitlines())
    assert 1 <= kept < 40
    rerun = run_cli(argv, env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == [f"c{i}" for i in range(40)]
