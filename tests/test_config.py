"""Run manifests: strict parsing, flag overrides, round trip, cross-field checks, CLI exit codes."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.config import (RunConfig, apply_overrides, load_manifest, normalize, parse_shard_subset,
                                to_toml)
from dflash_pipe.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, text):
    p = tmp_path / "m.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,needle", [
    ("[train]\nlrr = 1e-3\n", "unknown key 'lrr' in [train]"),
    ("[trainer]\nlr = 1e-3\n", "unknown section [trainer]"),
    ("[train]\nlr = \"fast\"\n", "[train] lr: expected a number"),
    ("[extract]\ntopk = 3.5\n", "[extract] topk: expected an integer"),
    ("[extract]\ncodec = \"zip\"\n", "'zip' is not one of lossless, fp8"),
    ("[extract]\nlayer_ids = 5\n", "expected a list"),
    ("[train\n", "not valid TOML"),
])
def test_bad_manifest_is_refused_naming_file_and_key(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(UsageError) as err:
        load_manifest(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_flags_override_file_and_resolved_config_round_trips(tmp_path):
    path = _write(tmp_path, "[train]\nlr = 1e-3\nepochs = 4\n[extract]\nlayer_ids = [1, 2]\n")
    cfg = load_manifest(path)
    apply_overrides(cfg, {("train", "lr"): "2e-4", ("extract", "layer_ids"): "3,4,5", ("train", "epochs"): None})
    assert cfg.train.lr == 2e-4 and cfg.train.epochs == 4 and cfg.extract.layer_ids == [3, 4, 5]
    again = load_manifest(_write(tmp_path, to_toml(cfg)))
    again.source = cfg.source
    assert again == cfg


def test_bad_flag_value_names_the_flag():
    with pytest.raises(UsageError, match="flag --num-anchors"):
        apply_overrides(RunConfig(), {("train", "num_anchors"): "many"}, lambda s, k: "--num-anchors")


def test_cross_field_rules_name_the_flags():
    cfg = RunConfig()
    cfg.extract.token_budget, cfg.extract.max_length = 100, 200
    with pytest.raises(UsageError, match="--token-budget .* --max-length"):
        normalize(cfg)


def test_a_negative_copy_anchor_weight_is_refused_naming_the_flag():
    cfg = RunConfig()
    cfg.train.copy_anchor_weight = -1.0
    with pytest.raises(UsageError, match="--copy-anchor-weight must be >= 0"):
        normalize(cfg)
    cfg.train.copy_anchor_weight = 2.0
    assert normalize(cfg).train.copy_anchor_weight == 2.0


def test_a_negative_step_cap_or_no_epochs_outside_the_window_mode_is_a_usage_error():
    """Both reached the trainer, which then said the cache 'yields no training batch' (exit 3, session 28's review)."""
    for field, value, needle in (("max_steps", -1, "--max-steps must be >= 0"), ("epochs", 0, "--epochs must be >= 1")):
        cfg = RunConfig()
        cfg.train.max_steps = 3
        setattr(cfg.train, field, value)
        with pytest.raises(UsageError, match=needle):
            normalize(cfg)
    cfg = RunConfig()
    cfg.train.epochs, cfg.train.passes_per_shard, cfg.train.follow = 0, 2, True   # the window mode counts passes
    assert normalize(cfg).train.epochs == 0


def test_grouped_attention_with_compile_on_is_refused_naming_both_flags():
    cfg = RunConfig()
    cfg.drafter.attention, cfg.train.compile = "sdpa-grouped", "on"
    with pytest.raises(UsageError, match="--drafter-attention sdpa-grouped .* --compile off"):
        normalize(cfg)
    for compile_ in ("auto", "off"):
        cfg.train.compile = compile_
        assert normalize(cfg).drafter.attention == "sdpa-grouped"


def test_shards_shorthand_and_subsets():
    cfg = RunConfig()
    cfg.extract.shards = "16"
    normalize(cfg)
    assert cfg.extract.num_shards == 16 and cfg.extract.shards == ""
    assert parse_shard_subset("0-3,7", 8) == [0, 1, 2, 3, 7] and parse_shard_subset("", 3) == [0, 1, 2]
    with pytest.raises(UsageError, match="outside 0..7"):
        parse_shard_subset("6-9", 8)
    with pytest.raises(UsageError, match="cannot parse"):
        parse_shard_subset("a-b", 8)
    with pytest.raises(UsageError, match="range '5-2' is reversed") as err:   # it used to select no shard at all
        parse_shard_subset("5-2", 8)
    assert err.value.hint == "use 2-5"


def test_a_manifest_not_in_utf8_or_with_a_bom(tmp_path):
    """Found by session 28's review: Latin-1 bytes crashed with a traceback (exit 1), a UTF-8 byte-order mark gave
    'not valid TOML' at line 1."""
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[data]\nsource = "caf\u00e9.jsonl"\n'.encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin.toml: not UTF-8 text \(byte 20\)"):
        load_manifest(latin)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[train]\nlr = 1e-3\n")
    assert load_manifest(bom).train.lr == 1e-3


def test_resolved_config_with_characters_outside_the_bmp_and_controls_round_trips(tmp_path):
    """JSON's ASCII escapes wrote an emoji as a surrogate pair, which TOML refuses: the resolved config a resume is
    told to use could not be read back (session 28's review)."""
    cfg = RunConfig()
    cfg.data.source = "data/chats_\U0001F680/caf\u00e9\x7f\ttab\"q.jsonl"
    again = load_manifest(_write(tmp_path, to_toml(cfg)))
    assert again.data.source == cfg.data.source


def test_shipped_manifests_parse():
    for m in (ROOT / "manifests").glob("*.toml"):
        normalize(load_manifest(m))


def test_cli_help_shows_field_docs_and_bad_keys_exit_2(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "dflash_pipe", *a], capture_output=True, text=True)  # noqa
    helptext = run("train", "--help")
    assert helptext.returncode == 0 and "Peak AdamW learning rate" in helptext.stdout
    assert "--drafter-num-layers" in helptext.stdout
    bad = run("train", "-m", str(_write(tmp_path, "[train]\nbogus = 1\n")))
    assert bad.returncode == 2 and "unknown key 'bogus'" in bad.stderr
    missing = run("cache", "info", str(tmp_path / "nothing"))
    assert missing.returncode == 3 and "no manifest.json" in missing.stderr
