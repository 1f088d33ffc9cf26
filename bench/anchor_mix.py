"""Where a training step's anchors fall, by --num-anchors and --max-anchors-per-doc, on the quality runs' own data.

SmolLM2's all-turn greedy-after-4 answers (bench/data/smollm2_all_turns_greedy4.jsonl.xz, the first --docs rows),
tokenized as extraction does (documents cut at 1,280 tokens), packed into 8,192-token rows, anchors drawn by the
loader's own block_targets. Prints per configuration: real (non-padding) anchors a row, and the share of anchors
in a second or later assistant turn and at positions prompt lookup could copy (train/anchors.copyable). CPU only:

    xz -dc bench/data/smollm2_all_turns_greedy4.jsonl.xz | head -6000 > /tmp/g4_6k.jsonl
    python bench/anchor_mix.py /tmp/g4_6k.jsonl
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_pipe.data.sources import iter_conversations  # noqa: E402
from dflash_pipe.data.tokenize import ConversationTokenizer  # noqa: E402
from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir  # noqa: E402
from dflash_pipe.train.anchors import copyable  # noqa: E402
from dflash_pipe.train.loader import block_targets  # noqa: E402

CONFIGS = [(512, 64), (512, 512), (1024, 64), (1024, 512), (2048, 512)]   # (--num-anchors, --max-anchors-per-doc)


def load_docs(path: str, max_length: int) -> list[tuple]:
    """(ids, loss mask, assistant-turn index per token, copyable per token) of each document."""
    from transformers import AutoTokenizer

    tok_dir = ensure_embedded_tokenizer_dir(Path("~/.cache/dflash-pipe/models").expanduser())
    ct = ConversationTokenizer(AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True), max_length)
    docs = []
    for conv in iter_conversations(path):
        s = ct(conv)
        if s is None:
            continue
        ids, m = np.asarray(s.input_ids, np.int64), np.asarray(s.loss_mask, np.uint8)
        starts = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(int)])) == 1)   # each assistant turn's start
        turn = np.zeros(len(m), int)
        for k, st in enumerate(starts):
            turn[st:] = k
        docs.append((ids, m, turn, copyable(ids)))
    return docs


def pack(docs: list[tuple], context: int, seed: int = 0) -> list[list[int]]:
    """Documents in a seeded order, greedily into rows of at most `context` tokens (the last row partial)."""
    rows, cur, n = [], [], 0
    for i in np.random.default_rng(seed).permutation(len(docs)):
        L = len(docs[i][0])
        if n + L > context and cur:
            rows.append(cur)
            cur, n = [], 0
        cur.append(int(i))
        n += L
    return rows + [cur] if cur else rows


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/g4_6k.jsonl"
    docs = load_docs(path, 1280)
    print(f"{len(docs)} documents, {np.mean([len(d[0]) for d in docs]):.0f} tokens on average, "
          f"{np.mean([d[1].mean() for d in docs]):.3f} supervised")
    rows = pack(docs, 8192)[:150]
    for N, cap in CONFIGS:
        real, later, copy, tot = [], 0, 0, 0
        rng = np.random.default_rng(1)
        for row in rows:
            ids = np.concatenate([docs[i][0] for i in row])
            ids = np.pad(ids, (0, 8192 - len(ids)))
            offs = np.cumsum([0] + [len(docs[i][0]) for i in row[:-1]])
            a, _, bdoc, valid, _ = block_targets(ids, [docs[i][1] for i in row], list(offs), N, 16, cap, rng)
            real.append(int(valid.sum()))
            for j in np.flatnonzero(valid):
                d, t = row[bdoc[j]], a[j] - offs[bdoc[j]]
                later += int(docs[d][2][t] > 0)
                copy += int(docs[d][3][t])
                tot += 1
        print(f"--num-anchors {N:5d} --max-anchors-per-doc {cap:4d}: real anchors a row {np.mean(real):7.1f} "
              f"(min {min(real)}), in a 2nd+ assistant turn {later / tot:.3f}, copyable {copy / tot:.3f}")


if __name__ == "__main__":
    main()
