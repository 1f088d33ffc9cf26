# Shared by stages/*.sh: environment, GPU list parsing, launcher (torchrun on GPUs, plain python on CPU).
set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$_repo/scripts/setup_env.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# NVLink multicast stays off on shared hosts (NCCL / PyTorch symmetric memory / NVSHMEM).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" \
       NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
# Per-rank Triton / Inductor caches go under this local directory (see dflash_pipe/dist.py).
export DFLASH_LOCAL_CACHE="${DFLASH_LOCAL_CACHE:-${TMPDIR:-/tmp}/dflash-pipe-kernels-$(id -u)}"

# No NVIDIA device node (nor WSL's /dev/dxg): no CUDA GPU, known without importing torch (seconds of CPU).
gpu_count() {
  if ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && [ ! -e /dev/dxg ]; then echo 0; return; fi
  "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
}

# launch STAGE GPUS ARGS...: one process per GPU in GPUS (comma list), or one CPU process if GPUS is "cpu".
launch() {
  local stage="$1" gpus="$2"; shift 2
  if [ "$gpus" != "cpu" ] && [ "$(gpu_count)" = 0 ]; then
    echo "stages: no CUDA GPU visible; running $stage on the CPU (one process) instead of GPUs $gpus" >&2
    gpus=cpu
  fi
  # exec: the stage's process group leader is python / torchrun itself, so run_pipeline.sh's SIGTERM reaches it
  # and its exit status is the stage's (a bash launcher in between would die of the signal at once)
  if [ "$gpus" = "cpu" ]; then
    exec "$PY" -m dflash_pipe "$stage" --device cpu "$@"
  else
    local n; n=$(awk -F, '{print NF}' <<<"$gpus")
    CUDA_VISIBLE_DEVICES="$gpus" exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$n" \
      -m dflash_pipe "$stage" "$@"
  fi
}
