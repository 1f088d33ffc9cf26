"""The eval's resume key (progress_log.run_key) names a drafter by its files' contents: a copy on another machine
resumes the progress made with the original, a retrained drafter does not."""

from __future__ import annotations

import os
import shutil

from dflash_pipe.eval.progress_log import run_key

IDENTITY = {"model": "embedded:smollm2-135m-instruct", "weights_fingerprint": "abc", "dtype": "float32"}


def test_a_copied_export_keeps_the_key_and_a_changed_one_does_not(tmp_path):
    a = tmp_path / "machine1" / "export"
    a.mkdir(parents=True)
    (a / "config.json").write_text('{"num_layers": 5}')
    (a / "model.safetensors").write_bytes(os.urandom(4096))
    key = run_key([("lossless", a)], IDENTITY, 256, 16, "heldout")
    b = tmp_path / "machine2" / "train-lossless" / "export"
    shutil.copytree(a, b)                                    # new path, new modification times
    os.utime(b / "model.safetensors", ns=(1, 1))
    assert run_key([("lossless", b)], IDENTITY, 256, 16, "heldout") == key
    assert run_key([("fp8", b)], IDENTITY, 256, 16, "heldout") != key          # another method name
    assert run_key([("lossless", b)], IDENTITY, 128, 16, "heldout") != key     # another token budget
    raw = bytearray((b / "model.safetensors").read_bytes())
    raw[100] ^= 1                                            # one bit of the weights, same size and time
    (b / "model.safetensors").write_bytes(bytes(raw))
    os.utime(b / "model.safetensors", ns=(1, 1))
    assert run_key([("lossless", b)], IDENTITY, 256, 16, "heldout") != key


def _result():
    from dflash_pipe.eval.specdecode import SpecResult

    return SpecResult([1, 2, 3], 4, accepted=[1], proposed=[1], slot_limit=[3], committed=[2])


def test_a_line_cut_by_a_kill_is_cut_off_before_the_next_append(tmp_path):
    """The cut fragment stayed at the end of the file, so the first record of the resumed eval was glued onto it
    and lost at the next resume, though it had been fsynced (session 28's review)."""
    from dflash_pipe.eval.progress_log import PROGRESS_FILE, EvalProgress

    p = EvalProgress(tmp_path, "k")
    p.add("s", "a", [5], [1, 2, 3], 0.1, {"ngram": _result()})
    with open(tmp_path / PROGRESS_FILE, "ab") as f:
        f.write(b'{"key": "k", "set": "s", "id": "b", "pro')                  # a kill mid-append
    p = EvalProgress(tmp_path, "k")
    assert sorted(p.done) == [("s", "a")]
    p.add("s", "c", [6], [1, 2, 3], 0.1, {"ngram": _result()})
    assert sorted(EvalProgress(tmp_path, "k").done) == [("s", "a"), ("s", "c")]
    assert (tmp_path / PROGRESS_FILE).read_bytes().count(b"\n") == 2


def test_a_prompt_whose_tokens_changed_under_the_same_id_is_decoded_again(tmp_path):
    """Held-out ids are the rows' own ids: a rerun on another data source (or chat template) took the old prompts'
    decodes from the file and reported them for prompts never asked (session 28's review)."""
    from dflash_pipe.eval.progress_log import EvalProgress

    EvalProgress(tmp_path, "k").add("heldout", "heldout/c0", [5, 6, 7], [1, 2, 3], 0.1, {"ngram": _result()})
    p = EvalProgress(tmp_path, "k")
    assert p.get("heldout", "heldout/c0", [5, 6, 7])[0] == [1, 2, 3]
    assert p.get("heldout", "heldout/c0", [5, 6, 8]) is None
