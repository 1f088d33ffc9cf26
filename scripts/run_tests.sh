#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up the environment if needed, run the CPU suite.
# GPU tests are opt-in: scripts/run_tests.sh -m gpu  (on a CUDA machine).
set -euo pipefail
cd "$(dirname "$0")/.."
DFLASH_TEST_EXTRA=1 source scripts/setup_env.sh
exec "$PY" -m pytest -q "$@"
