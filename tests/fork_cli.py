"""Run `dflash-pipe ARGS` (or a test helper) in a process of its own without paying Python's start-up.

The kill and signal tests need a real process: DFLASH_FAULT's SIGKILL must end it and nothing else, a
SIGINT / SIGTERM must reach only it, and what it leaves is read from disk afterwards. A plain
`python -m dflash_pipe` subprocess spends ~9 s of CPU importing torch and transformers before it does
anything; here each run is instead forked from a per-worker multiprocessing fork server that imported them
once (a fresh interpreter started for that, so no pytest or xdist thread is forked). Each run is still a
new process with its own pid, environment, signal handlers (Python's defaults) and exit status
(-9 when killed); only the interpreter start and the imports are shared. The `python -m dflash_pipe`
entry point itself stays covered by the tests that start it as a plain subprocess (exit codes, torchrun).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a stage imports on its way (transformers imports lazily); a name this version lacks is skipped.
PRELOAD = ["torch", "transformers", "pyarrow", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3_5.modeling_qwen3_5",
           "accelerate", "torch.utils.tensorboard", "boto3", "dflash_pipe.cli", "dflash_pipe.extract.pipeline",
           "dflash_pipe.train.trainer", "dflash_pipe.target.loading", "dflash_pipe.eval.runner"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(func, args, env: dict, cwd: str | None, stdout_path: str, stderr_path: str) -> None:
    """In the forked process: the test's environment and output files, then `func(*args)`; exit like Python."""
    os.environ.clear()
    os.environ.update(env)
    # Python's own SIGINT handler even where the test runner was started with SIGINT ignored (nohup, `&`): the
    # forkserver passes its parent's disposition on, and a stage would then never see the Ctrl-C a test sends
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cwd:
        os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        func(*args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def cli_main(argv: list[str]) -> None:
    from dflash_pipe.cli import main

    main(argv)


class ForkedRun:
    """The subset of subprocess.Popen the tests use: pid, poll, wait, send_signal, returncode, log_path."""

    def __init__(self, func, args, env: dict, log_dir: Path | None = None, stdout_path: Path | None = None,
                 stderr_path: Path | None = None, cwd: str | None = None):
        """Output goes to stdout_path / stderr_path (stderr_path None: into stdout_path when that is given,
        like stderr=STDOUT), else to fresh files in log_dir (default: the temp dir), never into the test's
        cache directories."""
        log_dir = Path(log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"dflash-fork-{os.getpid()}-{time.monotonic_ns()}"
        self._own_files = stdout_path is None  # files of our own naming: output() removes them
        if stdout_path is not None:
            self.stdout_path = Path(stdout_path)
            self.stderr_path = Path(stderr_path or stdout_path)
        else:
            self.stdout_path, self.stderr_path = log_dir / f"{stamp}.out", log_dir / f"{stamp}.err"
        for p in {self.stdout_path, self.stderr_path}:
            p.touch()
        self.log_path = self.stdout_path
        self._proc = _context().Process(target=_child, args=(func, tuple(args), dict(env), cwd,
                                                             str(self.stdout_path), str(self.stderr_path)))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"forked {self._proc.name}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) once the run has ended; temp files of our own naming are removed."""
        out, err = self.stdout_path.read_text(), self.stderr_path.read_text()
        if self._own_files and self.returncode is not None:
            for p in {self.stdout_path, self.stderr_path}:
                p.unlink(missing_ok=True)
        return out, err


def start_cli(argv: list[str], env: dict, log_dir: Path | None = None, **kw) -> ForkedRun:
    """`dflash-pipe ARGV` in a forked process (see the module doc); output in files under log_dir."""
    return ForkedRun(cli_main, [list(argv)], env, log_dir, **kw)


def run_cli(argv: list[str], env: dict, timeout: float = 300, log_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Like subprocess.run(capture_output=True, text=True) of `python -m dflash_pipe ARGV`; kills it on timeout."""
    run = start_cli(argv, env, log_dir)
    try:
        run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait(30)
        raise
    stdout, stderr = run.output()
    return subprocess.CompletedProcess(["dflash-pipe", *argv], run.returncode, stdout, stderr)
