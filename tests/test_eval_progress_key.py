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
