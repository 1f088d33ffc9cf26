"""Quality equivalence of window mode (issue #16, "Measure", second bullet).

One extraction of N conversations into n = 4K shards, then at once (both on the one device):
  * window: `train --follow --passes-per-shard K` on a hard-linked copy of the cache (the run deletes its
    links, the originals stay): the window holds K shards = 1/4 of the data, every document is read K times;
  * whole:  `train --epochs E+1 --max-steps S` on the whole cache (E = K; S = the window run's step count, so
    ~E epochs: the two schedules pack documents slightly differently);
  * seed:   (unless --no-seed-control) the whole run again with another --seed: the training-noise yardstick.
Then each final checkpoint is evaluated on the same held-out validation batches (the first --heldout
conversations, extracted as their own cache; every batch's anchors are a function of its position, so the
drafters are scored on identical blocks) and the simulated tau of window vs whole is compared: ratio - 1 and a
95 % percentile bootstrap over validation batches (paired). The 2026-12-01 quality run's seed-to-seed spread
was 1.6-4.3 %; the seed control measures it again at this size. Decoded tau: `dflash-pipe eval --drafter
window=...,whole=...` on the exports (--decoded-prompts N > 0; off by default, it does not fit 8 minutes).

    python bench/window_quality.py --json OUT.json         # H200, SmolLM2 (needs bench/gpu_bench.sh smollm2)
    python bench/window_quality.py --smoke --json OUT.json # CPU toy size (tiny random target)

H200 sizes (<= ~8 min): 4,000 SmolLM2-regenerated conversations (~1.9 M tokens, ~60 s to extract) in 16 shards,
K = E = 4 (window = 4 shards), the quality recipe's drafter (3 layers, 4,096-token contexts, 256 anchors):
~1,900 steps a run, 25-45 ms a step with three trainers sharing the GPU; 300 held-out conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.config import load_manifest, normalize, to_toml  # noqa: E402

BOOTSTRAP = 2000


def manifests(a, work: Path) -> dict[str, Path]:
    base = ROOT / "manifests" / ("tiny-qwen3.5.toml" if a.smoke else "quality-smollm2-gpu.toml")
    out = {}
    for name in ("extract", "val", "window", "whole", "seed"):
        cfg = load_manifest(base)
        d, ex, tr = cfg.data, cfg.extract, cfg.train
        d.source, d.format = a.data, "auto"
        if a.model_cache_dir:
            cfg.target.model_cache_dir = a.model_cache_dir
        d.skip_samples, d.max_samples = (0, a.heldout) if name == "val" else (a.heldout, a.samples)
        cfg.eval.prompts = "mtbench" if name == "val" else "heldout"  # heldout = the val cache's conversations
        ex.cache_dir = str(work / ("cache-val" if name == "val" else "cache"))
        ex.num_shards = 1 if name == "val" else 4 * a.passes
        ex.max_length, ex.max_cache_gib = a.max_length, 0.0
        tr.cache_dir = str(work / "cache-window") if name == "window" else ""
        tr.output_dir, tr.val_cache_dir = str(work / f"train-{name}"), str(work / "cache-val")
        tr.context_tokens, tr.num_anchors, tr.max_anchors_per_doc = a.context_tokens, a.num_anchors, a.num_anchors
        tr.checkpoint_every, tr.val_every, tr.log_every, tr.keep_checkpoints = 0, 10 ** 9, 10, 2
        tr.seed = 1 if name == "seed" else 0
        if name == "window":
            tr.follow, tr.passes_per_shard, tr.follow_poll_s, tr.max_steps = True, a.passes, 0.2, 0
        else:
            tr.epochs, tr.max_steps = a.passes, 0  # max_steps: the window run's count, on the command line
        if a.smoke:
            cfg.drafter.num_layers, cfg.drafter.block_size, tr.loader_workers = 1, 4, 1
        normalize(cfg)
        out[name] = work / f"{name}.toml"
        out[name].write_text(to_toml(cfg))
    return out


def run(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_pipe", *cmd], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def wait_all(procs: dict[str, subprocess.Popen], work: Path) -> None:
    for name, p in procs.items():
        if p.wait() != 0:
            tail = (work / f"{name}.log").read_text()[-3000:]
            raise SystemExit(f"{name} failed (exit {p.returncode}):\n{tail}")


def link_cache(src: Path, dst: Path) -> None:
    """A copy whose shard files are hard links: the window run deletes its links, not the data."""
    dst.mkdir(exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not (dst / p.name).exists() and p.name not in ("manifest.json",):
            os.link(p, dst / p.name)


def per_batch_tau(train_dir: Path, device: str) -> list[tuple[float, float]]:
    """(tau_sum, num_blocks) of every held-out validation batch for the run's final checkpoint."""
    import torch

    from dflash_pipe.drafter import default_gamma, draft_loss
    from dflash_pipe.train.checkpoint import complete_checkpoints
    from dflash_pipe.train.components import FrozenHead, build_drafter_config, build_model, resolve_param_dtype
    from dflash_pipe.train.master_weights import MasterWeights
    from dflash_pipe.train.trainer import _precision
    from dflash_pipe.train.validation import Validator, draft_inputs, kd_targets
    from safetensors.torch import load_file

    cfg = load_manifest(train_dir / "resolved_config.toml")
    tr, dev = cfg.train, torch.device(device)
    from dflash_pipe.cache import load_spec

    spec = load_spec(cfg.train_cache_dir)
    dcfg = build_drafter_config(cfg, spec, dev)
    precision = _precision(cfg, dev)
    head = FrozenHead(cfg.train_cache_dir, spec["features"]["head_file"], dev,
                      torch.bfloat16 if precision == "bf16" else torch.float32, scratch=train_dir / ".cache_head")
    model = build_model(dcfg, dev, tr.seed, False, tr.checkpoint_mlp_layers)
    weights = MasterWeights(model, resolve_param_dtype(cfg, precision))
    weights.load_master_state(load_file(str(complete_checkpoints(train_dir)[-1] / "model.safetensors")))
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else torch.autocast(
        dev.type, enabled=False)
    gamma = tr.gamma or default_gamma(dcfg.block_size)
    val = Validator(cfg, spec, dcfg, head, dev, 0, 1, autocast, gamma)
    out = []
    model.eval()
    with torch.no_grad():
        sched = val.loader.schedule(0, follow_first_epoch=False)
        for g in range(sched.steps):
            batch = val.loader.assemble(sched.batch(0, g), 0, g)
            t = {k: v.to(dev) for k, v in batch.tensors().items()}
            args = draft_inputs(t, batch, head, dcfg, val.codec, val.n_layers)
            with autocast:
                _, m = draft_loss(model(*args), head.lm_head_VH, t["labels_NB"], dcfg.block_size, gamma,
                                  tr.loss_chunk_tokens, kd_targets(t, dcfg, tr.kd_weight), fused=tr.fused_loss)
            out.append((float(m["tau_sum"]), float(m["num_blocks"])))
            batch.release()
    val.close()
    return out


def _total(train_dir: Path) -> int:
    from dflash_pipe.train.checkpoint import complete_checkpoints, read_state

    return int(read_state(complete_checkpoints(train_dir)[-1])["total_steps"])


def paired(a: list[tuple[float, float]], b: list[tuple[float, float]], seed: int = 0) -> dict:
    """tau(b) / tau(a) - 1 over the same validation batches, with a 95 % percentile bootstrap over batches."""
    def diff(idx):
        ta = sum(a[i][0] for i in idx) / sum(a[i][1] for i in idx)
        tb = sum(b[i][0] for i in idx) / sum(b[i][1] for i in idx)
        return tb / ta - 1

    ids = list(range(len(a)))
    rng = random.Random(seed)
    boot = sorted(diff([rng.choice(ids) for _ in ids]) for _ in range(BOOTSTRAP))
    return {"batches": len(ids), "diff": diff(ids), "ci95": [boot[int(0.025 * BOOTSTRAP)],
                                                             boot[int(0.975 * BOOTSTRAP) - 1]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--work", default="")
    p.add_argument("--json", default="")
    p.add_argument("--data", default=None, help="conversations (default: /tmp/quality/regenerated.jsonl on the "
                   "H200, bench/data's SmolLM2-regenerated ShareGPT for --smoke)")
    p.add_argument("--model-cache-dir", default="")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--heldout", type=int, default=None)
    p.add_argument("--passes", type=int, default=None, help="K = E")
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--num-anchors", type=int, default=None)
    p.add_argument("--no-seed-control", action="store_true")
    p.add_argument("--decoded-prompts", type=int, default=0, help="also decode this many held-out prompts")
    a = p.parse_args()
    sizes = (dict(samples=96, heldout=16, passes=2, max_length=192, context_tokens=512, num_anchors=32) if a.smoke
             else dict(samples=4000, heldout=300, passes=4, max_length=512, context_tokens=4096, num_anchors=256))
    for k, v in sizes.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.data is None:
        a.data = str(ROOT / "bench/data/smollm2_regenerated_sharegpt.jsonl.gz") if a.smoke else "/tmp/quality/regenerated.jsonl"
    work = Path(a.work) if a.work else Path(f"/tmp/window_quality-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    if a.data.endswith(".gz"):
        from bench.window_stream import data_file

        a.data = data_file(a.data, work)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    dev = ["--device", "cpu"] if a.smoke else []
    m = manifests(a, work)
    t0, times = time.time(), {}
    wait_all({"extract": run(["extract", "-m", str(m["extract"]), *dev], work / "extract.log", env),
              "val": run(["extract", "-m", str(m["val"]), *dev], work / "val.log", env)}, work)
    times["extract_s"] = time.time() - t0
    link_cache(work / "cache", work / "cache-window")
    t1 = time.time()
    wait_all({"window": run(["train", "-m", str(m["window"]), *dev], work / "window.log", env)}, work)
    steps = json.loads((work / "train-window" / "latest.json").read_text())["step"]
    times["window_s"] = time.time() - t1
    t2 = time.time()
    others = ["whole"] + ([] if a.no_seed_control else ["seed"])
    wait_all({n: run(["train", "-m", str(m[n]), "--max-steps", str(steps), "--epochs", str(a.passes + 1), *dev],
                     work / f"{n}.log", env) for n in others}, work)
    times["whole_s"] = time.time() - t2
    device = "cpu" if a.smoke else "cuda"
    tau = {n: per_batch_tau(work / f"train-{n}", device) for n in ["window", *others]}
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": a.smoke,
               "samples": a.samples, "heldout": a.heldout, "passes_K_epochs_E": a.passes, "shards": 4 * a.passes,
               "steps": {n: json.loads((work / f"train-{n}" / "latest.json").read_text())["step"]
                         for n in ["window", *others]},
               "lr_schedule_total_steps": {n: _total(work / f"train-{n}") for n in ["window", *others]},
               "sim_tau_heldout": {n: sum(x[0] for x in v) / sum(x[1] for x in v) for n, v in tau.items()},
               "window_vs_whole": paired(tau["whole"], tau["window"]),
               "seed_vs_whole": None if a.no_seed_control else paired(tau["whole"], tau["seed"]),
               "times_s": {**times, "total": time.time() - t0}, "work": str(work)}
    if a.decoded_prompts > 0:  # decoded tau on held-out prompts, every drafter on the same prompts (paired)
        from bench.quality_summary import paired as paired_prompts, per_prompt

        drafters = ",".join(f"{n}={work}/train-{n}/export" for n in ["window", *others])
        cmd = ["eval", "-m", str(m["whole"]), "--drafter", drafters, "--prompts", "heldout",
               "--max-prompts", str(a.decoded_prompts), "--data-skip-samples", str(a.heldout),
               "--output-dir", str(work / "eval"), *dev]
        t3 = time.time()
        wait_all({"eval": run(cmd, work / "eval.log", env)}, work)
        counts = per_prompt(work / "eval")
        dec = {n: counts.get(f"dflash:{n}", {}) for n in ["window", *others]}
        summary["decoded"] = {
            "prompts": a.decoded_prompts, "eval_s": time.time() - t3,
            "tau_heldout": {n: (sum(v[0] for v in c.values()) / sum(v[1] for v in c.values()) if c else None)
                            for n, c in dec.items()},
            "window_vs_whole": paired_prompts(dec["whole"], dec["window"]),
            "seed_vs_whole": None if a.no_seed_control else paired_prompts(dec["whole"], dec["seed"])}
    text = json.dumps(summary, indent=2)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
