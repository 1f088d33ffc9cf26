"""The eval report explains outputs that differ from target-only greedy decoding (eval/report.py)."""

from dflash_pipe.eval.report import identity_note, markdown_table, method_summary
from dflash_pipe.eval.specdecode import SpecResult

REFERENCE = [[5, 6, 7, 8], [9, 10, 11, 12]]


def _result(tokens):
    # two verify steps committing 2 + 2 tokens
    return SpecResult(list(tokens), block_size=4, target_forwards=3, proposed=[3, 3], accepted=[1, 1],
                      slot_limit=[3, 2], committed=[2, 2], wall_s=1.0, draft_s=0.1)


def _report(dtype, dflash_outputs, ngram_outputs=REFERENCE):
    summary = {"prompts": len(REFERENCE), "target_only": {"tokens_per_s": 4.0},
               "dflash:lossless": method_summary([_result(t) for t in dflash_outputs], REFERENCE, 4.0, True),
               "ngram": method_summary([_result(t) for t in ngram_outputs], REFERENCE, 4.0, True)}
    return {"target": {"dtype": dtype}, "sets": {"mtbench": summary}}


def test_no_note_when_every_output_matches():
    report = _report("bfloat16", REFERENCE)
    assert report["sets"]["mtbench"]["dflash:lossless"]["identical_to_target"] == 1.0
    assert identity_note(report) is None
    assert "Not every output" not in markdown_table(report)


def test_bf16_mismatch_names_the_method_the_fraction_and_the_flag():
    diverged = [REFERENCE[0], [9, 10, 99, 12]]
    report = _report("bfloat16", diverged)
    note = identity_note(report)
    assert "DFlash[lossless] on mtbench 50%" in note
    assert "n-gram" not in note                      # the baseline matched on both prompts
    assert "bfloat16" in note and "--target-dtype float32" in note
    assert note in markdown_table(report)


def test_fp32_mismatch_is_flagged_as_unexpected():
    report = _report("float32", REFERENCE, ngram_outputs=[[5, 6, 7, 0], [0, 10, 11, 12]])
    note = identity_note(report)
    assert "n-gram on mtbench 0%" in note and "DFlash" not in note
    assert "not expected" in note and "--target-dtype" not in note
