"""The seed's training shape and real-structure batches, shared by the GPU benchmarks.

Batches are built from bench/data/sharegpt_structure.npz (real ShareGPT document lengths and
assistant loss masks under a chat template), packed and anchored by the same code as training
(schedule.Packer, loader.block_targets); only the feature values are synthetic.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.train.loader import block_targets  # noqa: E402
from dflash_pipe.train.schedule import DocRef, Packer  # noqa: E402


@dataclass(frozen=True)
class SeedShape:
    context: int = 8192
    anchors: int = 512
    block: int = 16
    hidden: int = 5120
    layers: int = 5
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 17408
    vocab: int = 248320
    target_layers: int = 5  # captured target layers -> feature width 5 x 5120
    mask_token_id: int = 248070


def load_structure():
    z = np.load(Path(__file__).parent / "data" / "sharegpt_structure.npz")
    lens = z["lengths"]
    ids = z["input_ids"]
    masks = np.unpackbits(z["loss_mask"])[: ids.size].astype(np.uint8)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return [(ids[s:s + n], masks[s:s + n]) for s, n in zip(starts, lens)]


def structure_batches(shape: SeedShape, count: int, seed: int = 0, max_doc: int = 0):
    """`count` packed rows: dicts of numpy arrays (input_ids, ctx_doc, ctx_pos, anchors, labels...); documents cut
    to `max_doc` tokens when given (the quality runs extract at --max-length 1280), else to the context."""
    docs = load_structure()
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        order = rng.permutation(len(docs))
        packer = Packer(shape.context)
        for i in order:
            packer.add(DocRef(0, 0, int(i), min(len(docs[i][0]), max_doc or shape.context, shape.context)))
        packer.finish()
        for batch in packer.batches:
            S = shape.context
            input_ids = np.zeros(S, np.int64)
            ctx_doc = np.full(S, -1, np.int32)
            ctx_pos = np.zeros(S, np.int64)
            offsets, masks, off = [], [], 0
            for j, d in enumerate(batch):
                ids, mask = docs[d.row]
                T = d.num_tokens
                input_ids[off:off + T] = ids[:T]
                ctx_doc[off:off + T] = j
                ctx_pos[off:off + T] = np.arange(T)
                offsets.append(off)
                masks.append(mask[:T])
                off += T
            a, lab, bdoc, valid, _ = block_targets(input_ids, masks, offsets, shape.anchors, shape.block, 512, rng)
            out.append(dict(input_ids=input_ids, ctx_doc=ctx_doc, ctx_pos=ctx_pos, anchor_index=a, labels=lab,
                            block_doc=bdoc, block_valid=valid, tokens=off, docs=len(batch)))
            if len(out) >= count:
                break
    return out


def heavy_tailed_features(tokens: int, width: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, width, generator=g, device=device)
    x = x / torch.rand(tokens, width, generator=g, device=device).clamp_min(0.05).sqrt()
    x[:, 7] *= 100
    return x.to(torch.bfloat16)


def write_seed_shard(root: Path, shape: SeedShape, layers: int, batches: int, row_group_mb: int, workers: int,
                     meta: dict) -> tuple[int, object, float]:
    """A one-shard lossless cache at `root` holding the documents of `batches` packed rows (synthetic heavy-tailed
    features, `layers` captured layers), encoded on `workers` threads; finalized, so the loader can open it.
    Returns (feature width, the shard's ShardInfo, seconds spent encoding and writing the rows)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from dflash_pipe.cache import init_or_check_spec, make_spec, shard_name, try_finalize, write_sidecar
    from dflash_pipe.cache.codec import LOSSLESS, encode_hidden
    from dflash_pipe.cache.schema import shard_meta
    from dflash_pipe.cache.writer import ShardWriter, make_row

    width = shape.hidden * layers
    spec = make_spec(meta, {"hidden_size": shape.hidden}, {"width": width, "num_layers": layers, "codec": LOSSLESS,
                     "topk": 0, "layer_ids": list(range(layers))}, 1, {})
    init_or_check_spec(root, spec)
    w = ShardWriter(root, shard_name(0, 1), 0, LOSSLESS, 0, shard_meta(LOSSLESS, 0, width, layers, spec["fingerprint"]),
                    row_group_mb << 20)
    docs = structure_batches(shape, batches)
    feats = heavy_tailed_features(shape.context, width, 0)
    rows = []
    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        for bi, b in enumerate(docs):
            for s in np.flatnonzero(np.diff(np.concatenate([[-2], b["ctx_doc"]])) != 0):  # each document's start
                j = b["ctx_doc"][s]
                if j < 0:
                    continue
                T = int((b["ctx_doc"] == j).sum())
                rows.append(pool.submit(make_row, f"b{bi}d{j}", len(rows), b["input_ids"][s:s + T].astype(np.int32),
                                        (np.arange(T) > 0).astype(np.uint8),
                                        encode_hidden(feats[s:s + T], LOSSLESS, layers)))
        for r in rows:
            w.add(r.result())
        enc_s = time.perf_counter() - t0
    info = w.commit()
    write_sidecar(root, spec, info, {})
    try_finalize(root, spec)
    return width, info, enc_s
