"""Shared pytest setup: GPU tests are opt-in (`pytest -m gpu`), everything else runs on CPU."""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per pytest-xdist worker when the workers already fill the cores (CI: 2 workers, 2 cores):
# two workers with two OpenMP threads each, plus the subprocesses some tests start, oversubscribe the cores,
# and the threads' spin-waits made the eval tests 3-5x slower inside the suite than alone.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, (os.cpu_count() or 1) // _workers))
torch.set_num_threads(min(_threads, torch.get_num_threads()))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))     # inherited by the subprocesses tests start


def pytest_collection_modifyitems(config, items):
    # Files with a `slow` test first, each file's tests in their own order: `--dist loadfile` (scripts/run_tests.sh)
    # hands files to the two workers in this order, so the long ones start early and the short ones fill in
    # at the end, instead of one worker finishing a long file alone while the other idles.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
