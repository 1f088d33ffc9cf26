"""Write bench/data/sharegpt_structure.npz: real document lengths and loss masks (SmolLM2 chat template
over ShareGPT), so GPU benchmarks pack and anchor batches exactly like real training data.

    python bench/make_structure.py [--docs 600] [--max-length 8192]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from transformers import AutoTokenizer

    from dflash_pipe.data.sources import load_conversations
    from dflash_pipe.data.tokenize import ConversationTokenizer
    from dflash_pipe.target.embedded import ensure_embedded_tokenizer_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--max-length", type=int, default=8192)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_tokenizer_dir(Path("~/.cache/dflash-pipe/models").expanduser())))
    ctok = ConversationTokenizer(tok, args.max_length)
    ids, masks, lens = [], [], []
    for conv in load_conversations("embedded:sharegpt"):
        s = ctok(conv)
        if s is None:
            continue
        ids.append(s.input_ids)
        masks.append(s.loss_mask)
        lens.append(s.num_tokens)
        if len(lens) >= args.docs:
            break
    out = Path(__file__).parent / "data" / "sharegpt_structure.npz"
    np.savez_compressed(out, lengths=np.array(lens, np.int32), input_ids=np.concatenate(ids).astype(np.int32),
                        loss_mask=np.packbits(np.concatenate(masks).astype(bool)))
    print(f"{out}: {len(lens)} docs, {sum(lens)} tokens, mean length {np.mean(lens):.0f}")


if __name__ == "__main__":
    main()
