"""Cache codec benchmark: bytes/token vs raw bf16, encode/decode MB/s per core, fp8 error.

Data: (a) real activations — SmolLM2-135M-Instruct (embedded, real weights) hidden states at the
default 5 layers over real ShareGPT conversations; (b) a heavy-tailed synthetic set (Student-t
with an outlier channel, per-token scale). One thread (`torch.set_num_threads(1)`), so MB/s are
per core. MB/s count raw bf16 feature bytes (T x D x 2) processed per second.

    python bench/cache_codec.py [--tokens 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.cache.codec import (FP8, LOSSLESS, compress_hidden, decompress_hidden_into, encode_hidden,  # noqa: E402
                                     planes_shape, planes_to_hidden, zstd_compress)

ROW_TOKENS = 1024  # documents are cut into rows of this many tokens (typical conversation length)


def real_activations(tokens: int) -> tuple[torch.Tensor, int]:
    from dflash_pipe.config import TargetConfig
    from dflash_pipe.data.sources import load_conversations
    from dflash_pipe.data.tokenize import ConversationTokenizer
    from dflash_pipe.target.layers import default_target_layer_ids
    from dflash_pipe.target.loading import load_target
    from dflash_pipe.target.runner import TargetRunner

    t = TargetConfig()
    bundle = load_target(t.model, device=torch.device("cpu"), dtype=torch.float32, model_cache_dir=t.model_cache_dir)
    layers = default_target_layer_ids(5, bundle.num_layers)
    runner = TargetRunner(bundle, layers, topk=0, linear_attn_kernels="torch")
    ctok = ConversationTokenizer(bundle.tokenizer, ROW_TOKENS)
    out, n = [], 0
    for conv in load_conversations("embedded:sharegpt", max_samples=400):
        s = ctok(conv)
        if s is None:
            continue
        with torch.no_grad():
            o = runner.run(torch.from_numpy(s.input_ids).long(), [s.num_tokens])
        out.append(o.hidden_TD.to(torch.bfloat16))
        n += s.num_tokens
        if n >= tokens:
            break
    return torch.cat(out)[:tokens], len(layers)


def synthetic(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    x = g.standard_t(3, size=(tokens, width)).astype(np.float32)
    x *= np.exp(g.normal(0, 0.5, size=(tokens, 1))).astype(np.float32)
    x[:, 7] *= 200.0
    return torch.from_numpy(x).to(torch.bfloat16)


def _rows(hidden: torch.Tensor):
    return [hidden[i:i + ROW_TOKENS] for i in range(0, hidden.shape[0], ROW_TOKENS)]


def _time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_codec(hidden: torch.Tensor, codec: str, num_layers: int) -> dict:
    rows = _rows(hidden)
    raw = hidden.numel() * 2
    encoded = [compress_hidden(encode_hidden(r, codec, num_layers)) for r in rows]
    stored = sum(len(v) if isinstance(v, bytes) else v.nbytes for e in encoded for v in e.values())
    enc_s = _time(lambda: [compress_hidden(encode_hidden(r, codec, num_layers)) for r in rows])
    D = hidden.shape[1]
    mv = [{k: memoryview(v if isinstance(v, bytes) else v.tobytes()) for k, v in e.items()} for e in encoded]

    def decode_planes():
        outs = []
        for r, m in zip(rows, mv):
            planes = torch.empty(planes_shape(codec, D, r.shape[0]), dtype=torch.uint8)
            scale = torch.empty(r.shape[0], num_layers) if codec == FP8 else None
            decompress_hidden_into(codec, m, r.shape[0], D, planes, scale, 0)
            outs.append((planes, scale))
        return outs

    def decode_full():
        return [planes_to_hidden(codec, p, s, num_layers) for p, s in decode_planes()]

    dec_planes_s = _time(decode_planes)
    dec_full_s = _time(decode_full)
    res = {"codec": codec, "ratio": stored / raw, "bytes_per_token": stored / hidden.shape[0],
           "encode_MBps": raw / enc_s / 1e6, "decode_planes_MBps": raw / dec_planes_s / 1e6,
           "decode_cpu_bf16_MBps": raw / dec_full_s / 1e6}
    if codec == LOSSLESS:
        back = torch.cat(decode_full())
        res["bit_exact"] = bool(torch.equal(back.view(torch.int16), hidden.view(torch.int16)))
    else:
        back = torch.cat(decode_full()).float()
        ref = hidden.float()
        rel = (back - ref).norm(dim=-1) / ref.norm(dim=-1)
        res.update(rel_l2_mean=float(rel.mean()), rel_l2_max=float(rel.max()),
                   cos_min=float(torch.nn.functional.cosine_similarity(back, ref, dim=-1).min()))
    return res


def bench_baselines(hidden: torch.Tensor) -> list[dict]:
    """Reference points: interleaved bf16 + zstd-1, token-major byte split (what SPEC §2 measured)."""
    rows = _rows(hidden)
    raw = hidden.numel() * 2
    out = []
    inter = sum(len(zstd_compress(r.contiguous().view(torch.uint8).numpy().tobytes())) for r in rows)
    out.append({"codec": "bf16 interleaved + zstd-1", "ratio": inter / raw})
    tm = 0
    for r in rows:
        u = r.contiguous().view(torch.uint8).view(-1, 2)
        tm += len(zstd_compress(u[:, 1].contiguous().numpy().tobytes())) + u.shape[0]
    out.append({"codec": "token-major split (hi zstd-1, lo raw)", "ratio": tm / raw})
    u = hidden.contiguous().view(torch.uint8).view(-1, 2).numpy()
    ent = 0.0
    for plane in (u[:, 0], u[:, 1]):
        p = np.bincount(plane, minlength=256) / plane.size
        ent += -(p[p > 0] * np.log2(p[p > 0])).sum()
    out.append({"codec": "order-0 entropy bound (per byte plane)", "ratio": ent / 16})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--json", type=str, default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    real, nl = real_activations(args.tokens)
    sets = {"smollm2-real": (real, nl), "synthetic-heavy-tailed": (synthetic(args.tokens, real.shape[1]), nl)}
    results = []
    for name, (h, n_layers) in sets.items():
        for base in bench_baselines(h):
            results.append({"data": name, **base})
        for codec in (LOSSLESS, FP8):
            results.append({"data": name, **bench_codec(h, codec, n_layers)})
    print(f"\n{'data':24s} {'codec':40s} {'ratio':>6s} {'enc MB/s':>9s} {'dec planes':>10s} {'dec bf16':>9s}  extra")
    for r in results:
        extra = ""
        if "rel_l2_mean" in r:
            extra = f"relL2 mean {r['rel_l2_mean']:.4f} max {r['rel_l2_max']:.4f} cos_min {r['cos_min']:.5f}"
        elif "bit_exact" in r:
            extra = f"bit-exact {r['bit_exact']}"
        f = lambda k: f"{r[k]:9.0f}" if k in r else f"{'':9s}"  # noqa: E731
        print(f"{r['data']:24s} {r['codec']:40s} {r['ratio']:6.3f} {f('encode_MBps')} {f('decode_planes_MBps'):>10s} "
              f"{f('decode_cpu_bf16_MBps')}  {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
