#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up the environment if needed, run the CPU suite.
# GPU tests are opt-in: scripts/run_tests.sh -m gpu  (on a CUDA machine).
set -euo pipefail
cd "$(dirname "$0")/.."
DFLASH_TEST_EXTRA=1 source scripts/setup_env.sh
# The CPU suite runs in DFLASH_TEST_WORKERS (2) processes, a test file per worker at a time (--dist loadfile:
# module fixtures such as a file's tiny extraction are built once): many tests wait on subprocesses (SIGKILL
# matrices, torchrun ranks, follow-mode polls), so two workers keep both cores busy. `-m gpu` runs serially
# (one GPU), as does DFLASH_TEST_WORKERS=0. --no-loadscope-reorder keeps tests/conftest.py's order (files with
# slow tests first); xdist's default order (most tests per file first) left the long files to the end.
workers=()
if [ "${DFLASH_TEST_WORKERS:-2}" != 0 ] && [[ " $* " != *" -m gpu "* ]] && [[ " $* " != *" -n "* ]] \
   && "$PY" -c "import xdist" >/dev/null 2>&1; then
  workers=(-n "${DFLASH_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
fi
exec "$PY" -m pytest -q "${workers[@]}" "$@"
