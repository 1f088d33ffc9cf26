"""The export carries every key the serving engines read (SERVING.md), in each engine's own convention,
and `--with-modeling-code` builds, through transformers' remote code, a model equal to the project's drafter.

The `*_reads` functions restate, from SERVING.md, how each engine resolves a key (precedence and
index convention). They are this project's reading of the engines' source, kept small so that a
changed export that an engine would read differently fails here."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from dflash_pipe.drafter.export import MODELING_NAME, export_drafter, load_exported_drafter
from dflash_pipe.drafter.masks import AttentionMask
from dflash_pipe.drafter.model import DFlashDrafter
from dflash_pipe.target import default_target_layer_ids
from tests.test_drafter_support import random_packed_row, randomize_, tiny_config


def vllm_reads(conf: dict) -> dict:
    """vLLM main (eagle3_utils.get_eagle3_aux_layers_from_config, qwen3_dflash.py)."""
    aux = conf.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in conf["dflash_config"]["target_layer_ids"]]
    dflash = dict(conf.get("eagle_config") or {}, **conf["dflash_config"])
    layer_types = conf.get("layer_types")
    causal = [bool(conf["is_causal"]) if conf.get("is_causal") is not None else
              dflash.get("causal", bool(layer_types) and layer_types[i] == "sliding_attention")
              for i in range(conf["num_hidden_layers"])]
    return {"captured_inputs_of_layers": aux,
            "fc_in": (conf.get("target_hidden_size") or conf["hidden_size"]) * len(aux),
            "mask_token_id": dflash.get("mask_token_id", conf.get("mask_token_id")),
            "rope_theta": (conf.get("rope_parameters") or {}).get("rope_theta", 1e6),
            "neox": conf.get("is_neox_style", True), "causal": causal,
            "vocab": conf.get("draft_vocab_size") or conf["vocab_size"], "act": conf["hidden_act"]}


def sglang_reads(conf: dict) -> dict:
    """SGLang main (speculative/dflash_utils.parse_dflash_draft_config, models/dflash.py)."""
    d = conf.get("dflash_config") or {}
    ids = d.get("target_layer_ids", conf.get("target_layer_ids"))
    num_target = d.get("num_target_layers", conf.get("num_target_layers", conf["num_hidden_layers"]))
    assert all(0 <= i < num_target for i in ids), "SGLang refuses out-of-range target_layer_ids"
    rope = conf.get("rope_parameters")
    return {"captured_inputs_of_layers": [i + 1 for i in ids], "fc_in": conf["hidden_size"] * len(ids),
            "block_size": d.get("block_size", conf.get("block_size", 16)),
            "mask_token_id": d.get("mask_token_id", conf.get("mask_token_id")),
            "rope_theta": rope["rope_theta"] if rope is not None else conf["rope_theta"],
            "non_causal": [t == "full_attention" for t in conf["layer_types"]], "act": conf.get("hidden_act", "silu")}


def zlab_reads(conf: dict) -> dict:
    """z-lab/dflash dflash/model.py (_draft_value: dflash_config first, then the top level)."""
    d = conf.get("dflash_config") or {}

    def value(name, default=None):
        return d.get(name, conf.get(name, default))

    return {"hidden_states_index": [i + 1 for i in value("target_layer_ids")],
            "fc_in": len(value("target_layer_ids")) * conf["hidden_size"], "block_size": value("block_size", 16),
            "mask_token_id": value("mask_token_id")}


@pytest.fixture()
def exported(tmp_path):
    cfg = tiny_config(num_layers=2, mask_token_id=61, rope_theta=1e6)
    model = DFlashDrafter(cfg)
    randomize_(model, 5)
    return model, cfg, export_drafter(model, cfg, tmp_path / "export")


def test_each_engine_resolves_layers_block_mask_rope_and_attention_as_trained(exported):
    model, cfg, out = exported
    conf = json.loads((out / "config.json").read_text())
    fc_in = model.fc.weight.shape[1]
    ours = list(cfg.target_layer_ids)                    # layer outputs = HF hidden_states[id + 1]
    v, s, z = vllm_reads(conf), sglang_reads(conf), zlab_reads(conf)
    # vLLM and SGLang capture the *input* of layer id + 1, which is the output of layer id.
    assert conf["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours]
    assert v["captured_inputs_of_layers"] == s["captured_inputs_of_layers"] == z["hidden_states_index"] \
        == [i + 1 for i in ours]
    assert v["fc_in"] == s["fc_in"] == z["fc_in"] == fc_in
    assert s["block_size"] == z["block_size"] == cfg.block_size
    assert v["mask_token_id"] == s["mask_token_id"] == z["mask_token_id"] == 61
    assert v["rope_theta"] == s["rope_theta"] == cfg.rope_theta and v["neox"] is True
    assert v["causal"] == [False] * cfg.num_layers and s["non_causal"] == [True] * cfg.num_layers
    assert v["act"] == s["act"] == "silu" and v["vocab"] == cfg.vocab_size


def test_an_older_export_without_the_vllm_key_resolves_the_same(exported):
    """A config without eagle_aux_hidden_state_layer_ids (exports before this change) falls back to
    dflash_config.target_layer_ids + 1 in vLLM main: the new key must agree with that fallback."""
    _, _, out = exported
    conf = json.loads((out / "config.json").read_text())
    old = {k: v for k, v in conf.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert vllm_reads(old) == vllm_reads(conf)
    wrong = dict(conf, eagle_aux_hidden_state_layer_ids=conf["dflash_config"]["target_layer_ids"])
    assert vllm_reads(wrong)["captured_inputs_of_layers"] != vllm_reads(conf)["captured_inputs_of_layers"]


@pytest.mark.parametrize("n,L", [(5, 30), (5, 36), (5, 64), (3, 8), (2, 5), (1, 30)])
def test_default_layer_rule_is_servable_by_vllm(n, L):
    """vLLM captures the input of layer id + 1: it exists for id < L - 1 only."""
    assert max(i + 1 for i in default_target_layer_ids(n, L)) < L


def test_modeling_code_builds_the_same_drafter_through_transformers(exported, tmp_path):
    from transformers import AutoModel

    model, cfg, plain = exported
    assert not (plain / MODELING_NAME).exists() and "auto_map" not in json.loads((plain / "config.json").read_text())
    out = export_drafter(model, cfg, tmp_path / "with-code", with_modeling_code=True)
    conf = json.loads((out / "config.json").read_text())
    assert conf["auto_map"]["AutoModel"] == "modeling_dflash_pipe.DFlashPipeDraftModel"
    assert {k: v for k, v in conf.items() if k != "auto_map"} == json.loads((plain / "config.json").read_text())
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlashPipeDraftModel" and type(remote).__module__.startswith("transformers_modules")
    ours, _ = load_exported_drafter(out, dtype=torch.float32)
    assert remote.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(remote.state_dict()[k], t) for k, t in ours.state_dict().items())

    row = random_packed_row(8, doc_lens=(7, 12), pad_ctx=2, blocks_per_doc=3, pad_blocks=1, block_size=cfg.block_size)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(row.S, cfg.num_target_features * cfg.hidden_size, generator=g)
    embeds = torch.randn(row.N * cfg.block_size, cfg.hidden_size, generator=g)
    mask = AttentionMask(row.ctx_doc, row.anchor_index, row.block_doc, row.block_valid, row.block_size)
    B, checked = cfg.block_size, 0
    with torch.no_grad():
        packed = ours(feats, embeds, row.ctx_pos, row.block_pos(), mask)
        for j in range(row.N):
            if not bool(row.block_valid[j]):
                continue
            a, doc = int(row.anchor_index[j]), int(row.block_doc[j])
            ctx = [c for c in range(a) if int(row.ctx_doc[c]) == doc]
            pos = torch.cat([row.ctx_pos[ctx], row.block_pos()[j * B:(j + 1) * B]])[None]
            got = remote(target_hidden=feats[ctx][None], noise_embedding=embeds[j * B:(j + 1) * B][None],
                         position_ids=pos)[0]
            torch.testing.assert_close(got, packed[j * B:(j + 1) * B], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == int(row.block_valid.sum()) >= 4
    with pytest.raises(ValueError, match="target_hidden has shape"):
        remote(target_hidden=feats[None, :, :8], noise_embedding=embeds[None, :B], position_ids=pos)

    # re-exporting without the code removes it (no stale auto_map target left behind)
    export_drafter(model, cfg, out)
    assert not (out / MODELING_NAME).exists() and "auto_map" not in json.loads((out / "config.json").read_text())


def test_modeling_file_imports_only_torch_and_transformers():
    path = Path(__file__).parents[1] / "dflash_pipe" / "drafter" / MODELING_NAME
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the file is copied alone"
            roots.add(node.module.split(".")[0])
    assert roots == {"__future__", "torch", "transformers"}


def test_cli_export_with_modeling_code(exported, tmp_path):
    from dflash_pipe.cli import app

    model, cfg, _ = exported
    ckpt = tmp_path / "train" / "ckpt-7"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "state.json").write_text(json.dumps({"drafter_config": cfg.to_dict()}))
    (ckpt / "COMPLETE").write_text("")
    res = CliRunner().invoke(app, ["export", str(tmp_path / "train"), "-o", str(tmp_path / "o"), "--with-modeling-code"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / MODELING_NAME).read_bytes() == (Path(__file__).parents[1] / "dflash_pipe" / "drafter"
                                                             / MODELING_NAME).read_bytes()
    assert "auto_map" in json.loads((tmp_path / "o" / "config.json").read_text())
