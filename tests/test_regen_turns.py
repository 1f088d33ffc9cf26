"""regenerate's first prompts tokenized ahead on a worker thread (regen_turns.PromptReadAhead): the same output as
tokenizing them in the loop, input order kept, nothing tokenized that will not be generated."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dflash_pipe.eval import regen_turns
from dflash_pipe.eval.regen_turns import ConvState, PromptReadAhead, first_prompt
from dflash_pipe.eval.regenerate import run_regenerate
from dflash_pipe.eval.runner import encode_prompts
from tests.eval_helpers import llama  # noqa: F401 - pytest fixture
from tests.test_eval_regenerate import NEW, cfg  # noqa: F401 - pytest fixture

SAMPLING = dict(samples=2, temperature=0.9, top_p=0.95, seed=7)


def _spy(monkeypatch):
    """Record each encode_prompts call of regen_turns: (thread name, number of prompts)."""
    calls = []

    def spy(tok, convs, failed=None):
        calls.append((threading.current_thread().name, len(convs)))
        return encode_prompts(tok, convs, failed)

    monkeypatch.setattr(regen_turns, "encode_prompts", spy)
    return calls


def test_read_ahead_gives_the_loops_output_and_tokenizes_first_prompts_on_the_worker(cfg, llama, tmp_path,
                                                                                      monkeypatch):
    runs = {}
    for on in (False, True):
        calls = _spy(monkeypatch)
        out = tmp_path / f"prefetch-{on}.jsonl"
        state = run_regenerate(cfg, out, max_new_tokens=NEW, batch_size=2, device="cpu", bundle=llama,
                               prefetch_prompts=on, **SAMPLING)
        runs[on] = (out.read_bytes(), state, calls)
    assert runs[True][0] == runs[False][0]  # byte for byte, sampled, every turn, two samples a conversation
    assert runs[True][1]["generated_tokens"] == runs[False][1]["generated_tokens"]
    worker = [n for name, n in runs[True][2] if name.startswith("dflash-tokenize")]
    loop_on = sum(n for name, n in runs[True][2] if not name.startswith("dflash-tokenize"))
    loop_off = sum(n for _, n in runs[False][2])
    # ROWS: 6 chat conversations, each with a first prompt (c's leading answer is dropped; the text row is not chat),
    # tokenized once each on the worker; the loop then tokenizes the later turns only, both samples of each
    assert worker == [6] and not any(name.startswith("dflash-tokenize") for name, _ in runs[False][2])
    assert loop_on == loop_off - 2 * 6


def test_read_ahead_keeps_input_order_across_chunks_and_skips_what_will_not_be_generated(llama):
    tok = llama.tokenizer
    msgs = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "a"}] for i in range(7)]
    msgs[3] = [{"role": "assistant", "content": "an answer to nothing"}]              # no first prompt
    convs = [SimpleNamespace(sample_id=f"s{i}", messages=m, is_text=False) for i, m in enumerate(msgs)]
    ahead = PromptReadAhead(iter(convs), tok, wanted=lambda c: c.sample_id != "s5", chunk=2, depth=2)
    got = []
    while (item := ahead.next()) is not None:
        got.append(item)
    assert [c.sample_id for c, _ in got] == [c.sample_id for c in convs]
    assert [ids is None for _, ids in got] == [False, False, False, True, False, True, False]
    for conv, ids in got:
        if ids is not None:
            assert ids.ids() == encode_prompts(tok, [first_prompt(conv.messages)])[0]
    ahead.close()
    off = PromptReadAhead(iter(convs), tok, wanted=lambda c: True, enabled=False)
    assert [off.next() for _ in range(8)] == [(c, None) for c in convs] + [None]


def test_first_prompt_is_the_states_first_prompt():
    m = [{"role": "assistant", "content": "lead"}, {"role": "system", "content": "s"},
         {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    st = ConvState("x", m)
    assert first_prompt(m) == st.next_prompt() == [m[1], m[2]]
    assert first_prompt([{"role": "user", "content": "only"}]) is None


def test_answers_are_detokenized_in_one_batch_exactly_as_one_by_one(llama):
    """Regenerator.decode_texts: with the fast tokenizer, one Rust batch call gives what `decode(ids,
    skip_special_tokens=True)` gives each answer (special tokens, an empty answer, a one-token one), and the batch
    path is taken, with the clean-up pass where decode runs it; a tokenizer whose batch decode disagrees on the first
    batch, or one without a Rust backend, is decoded one by one for the whole run."""
    import torch

    from dflash_pipe.eval.regen_sampling import Decoding
    from dflash_pipe.eval.regen_turns import Regenerator

    tok = llama.tokenizer
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, len(tok), (int(n),), generator=g).tolist() for n in (40, 1, 0, 300, 17)]
    seqs[0][3] = seqs[3][0] = int(tok.eos_token_id)                    # special tokens are skipped
    want = [tok.decode(s, skip_special_tokens=True) for s in seqs]
    reg = Regenerator(tok, [int(tok.eos_token_id)], 8, 512, 1, Decoding())
    assert reg.decode_texts(seqs) == want and callable(reg._batch_decode)
    assert reg.decode_texts(seqs[::-1]) == want[::-1]

    # a decode that runs the clean-up pass (as transformers 5.17 did for SmolLM2's BPE tokenizer on the H100): the
    # batch path cleans up too; one that says it cleans up but does not (5.25 skips it for BPE): the raw batch path
    clean = tok.clean_up_tokenization
    seqs2 = [tok.encode(t, add_special_tokens=False) for t in ("Yes , it 's done . Is n't it ?", "plain")] + seqs
    for cleans in (True, False):
        def decode(q, skip_special_tokens, cleans=cleans):
            text = tok.decode(q, skip_special_tokens=skip_special_tokens)
            return clean(text) if cleans else text
        stand_in = SimpleNamespace(backend_tokenizer=tok.backend_tokenizer, encode=tok.encode, decode=decode,
                                   clean_up_tokenization=clean, clean_up_tokenization_spaces=True)
        reg = Regenerator(stand_in, [0], 8, 512, 1, Decoding())
        got = reg.decode_texts(seqs2)
        assert callable(reg._batch_decode) and got == [decode(q, True) for q in seqs2]
        assert (got[0] == "Yes, it's done. Isn't it?") is cleans

    batches = []
    wrong = SimpleNamespace(decode_batch=lambda s, skip_special_tokens: batches.append(len(s)) or ["?"] * len(s))
    stand_in = SimpleNamespace(backend_tokenizer=wrong, clean_up_tokenization_spaces=False, decode=tok.decode)
    reg = Regenerator(stand_in, [0], 8, 512, 1, Decoding())
    assert reg.decode_texts(seqs) == want and reg.decode_texts(seqs) == want
    assert reg._batch_decode is False and batches == [5]               # probed once, never used
    slow = SimpleNamespace(decode=tok.decode)
    assert Regenerator(slow, [0], 8, 512, 1, Decoding()).decode_texts(seqs) == want
