"""dflash_pipe.dist.set_rank_cache_dirs: each rank's Triton and Inductor caches in their own directory, even after
torch._inductor's import has written its default cache dir into the environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, sys
import dflash_pipe.drafter                     # compiles at import: torch._inductor writes its default cache dir
import torch._inductor.config
seen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
from torch._inductor.runtime.cache_dir_utils import cache_dir
from dflash_pipe.dist import DistInfo, set_rank_cache_dirs
set_rank_cache_dirs(DistInfo(int(sys.argv[1]), 2, int(sys.argv[1])), "train")
print(json.dumps({"seen": seen, "inductor": cache_dir(), "triton": os.environ.get("TRITON_CACHE_DIR")}))
"""


def _probe(rank: int, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, str(rank)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={k: v for k, v in env.items() if v is not None})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_each_rank_gets_its_own_inductor_and_triton_cache_unless_the_user_chose_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["DFLASH_LOCAL_CACHE"] = str(tmp_path / "kernels")
    got = [_probe(rank, env) for rank in (0, 1)]
    for rank, g in enumerate(got):
        assert g["seen"] is not None and "torchinductor_" in g["seen"]    # inductor's default, set at its import
        assert g["inductor"] == str(tmp_path / "kernels" / f"train-rank{rank}" / "inductor")   # what inductor uses
        assert g["triton"] == str(tmp_path / "kernels" / f"train-rank{rank}" / "triton")
    mine = _probe(0, {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})   # the user's choice stays
    assert mine["inductor"] == str(tmp_path / "mine") and mine["triton"].endswith("train-rank0/triton")
