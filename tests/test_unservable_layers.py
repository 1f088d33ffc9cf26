"""The target's last layer (id L-1) is refused at extract, plan and train time unless the user says the drafter
will not be servable by vLLM ([extract] allow_unservable_layers / --allow-unservable-layers)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from dflash_pipe.config import RunConfig, normalize
from dflash_pipe.errors import UsageError
from dflash_pipe.target import default_target_layer_ids
from dflash_pipe.target.layers import check_servable
from dflash_pipe.train.components import build_drafter_config
from tests.cache_helpers import write_train_cache

REPO = Path(__file__).parents[1]


def test_check_names_the_layer_and_the_override():
    check_servable([1, 8, 27], 30, False, "pass --x")                       # below L-1: fine
    check_servable([1, 29], 30, True, "pass --x")                           # explicitly allowed
    with pytest.raises(UsageError, match=r"include 29, the last layer of this 30-layer target") as err:
        check_servable([1, 29], 30, False, "pass --allow-unservable-layers")
    assert err.value.exit_code == 2 and "pass --allow-unservable-layers" in str(err.value.hint)


@pytest.mark.parametrize("L", [1, 2])
def test_one_layer_default_on_a_tiny_target_is_the_last_layer_and_is_refused(L):
    ids = default_target_layer_ids(1, L)                                   # n == 1 -> [L // 2] = [L - 1]
    assert ids == [L - 1]
    with pytest.raises(UsageError, match="cannot serve"):
        check_servable(ids, L, False, "pass --x")


def test_shipped_manifests_choose_servable_layers():
    # decoder layers of each manifest's target (a new target here must be added with its layer count)
    layers = {"embedded:smollm2-135m-instruct": 30, "random:tiny-qwen3.5": 8, "/models/Qwen3.6-27B": 64}
    for path in sorted((REPO / "manifests").glob("*.toml")):
        m = tomllib.loads(path.read_text())
        ex, model = m.get("extract", {}), m["target"]["model"]
        assert not ex.get("allow_unservable_layers", False), path.name
        ids = ex.get("layer_ids") or default_target_layer_ids(ex.get("num_target_layers", 5), layers[model])
        check_servable(ids, layers[model], False, "n/a")


def _train_cfg(cache, out, allow=False) -> RunConfig:
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.extract.allow_unservable_layers = allow
    return normalize(cfg)


def test_train_refuses_a_cache_with_the_last_layer_unless_allowed(tmp_path):
    cache = tmp_path / "cache"
    write_train_cache(cache)                                               # target of 6 layers, ids [1, 4]
    spec = json.loads((cache / "cache_spec.json").read_text())
    assert build_drafter_config(_train_cfg(cache, tmp_path / "o"), spec, torch.device("cpu")).target_layer_ids == [1, 4]
    spec["features"]["layer_ids"] = [1, 5]                                 # 5 = L - 1
    with pytest.raises(UsageError, match="include 5, the last layer") as err:
        build_drafter_config(_train_cfg(cache, tmp_path / "o"), spec, torch.device("cpu"))
    assert "allow_unservable_layers = true" in err.value.hint
    assert build_drafter_config(_train_cfg(cache, tmp_path / "o", allow=True), spec,
                                torch.device("cpu")).target_layer_ids == [1, 5]
    spec["extract"] = {"allow_unservable_layers": True}                    # recorded by an allowed extract
    assert build_drafter_config(_train_cfg(cache, tmp_path / "o"), spec, torch.device("cpu")).target_layer_ids == [1, 5]


def test_extract_refuses_before_writing_anything(tmp_path, monkeypatch):
    """The check runs right after the target is loaded (its layer count is needed) and before any file is
    written; the target is replaced by its layer count here (the end-to-end extraction is test_extract_e2e)."""
    from types import SimpleNamespace

    import dflash_pipe.target.loading as loading
    from dflash_pipe.config import load_manifest
    from dflash_pipe.extract.pipeline import run_extract

    class Loaded(Exception):
        pass

    def fake_load_target(*args, **kwargs):
        return SimpleNamespace(num_layers=8, hidden_size=64, config=SimpleNamespace())

    monkeypatch.setattr(loading, "load_target", fake_load_target)
    cfg = load_manifest(REPO / "manifests" / "tiny-qwen3.5.toml")
    cache = tmp_path / "cache"
    cfg.extract.cache_dir, cfg.extract.layer_ids, cfg.extract.device = str(cache), [1, 7], "cpu"
    with pytest.raises(UsageError, match="include 7, the last layer of this 8-layer target") as err:
        run_extract(normalize(cfg))
    assert "--allow-unservable-layers" in err.value.hint and not cache.exists()
    cfg.extract.layer_ids = []                     # the default for 3 of 8 layers: [1, 3, 5], servable
    cfg.extract.allow_unservable_layers = False
    monkeypatch.setattr("dflash_pipe.extract.pipeline.dataset_fingerprint",
                        lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    with pytest.raises(Loaded):                    # got past the check (to the data fingerprint)
        run_extract(normalize(cfg))
    cfg.extract.layer_ids, cfg.extract.allow_unservable_layers = [1, 7], True
    with pytest.raises(Loaded):
        run_extract(normalize(cfg))


def test_extract_refuses_a_max_length_past_the_context_or_a_sliding_window():
    """Extraction's masks are block-causal without a window, and positions stop at the model's context: an
    [extract] max_length past either is a usage error naming the limit and the manifest setting."""
    from types import SimpleNamespace

    from dflash_pipe.target.layers import check_extract_length

    check_extract_length(SimpleNamespace(), 4096)                         # nothing known: nothing refused
    check_extract_length(SimpleNamespace(max_position_embeddings=4096, sliding_window=4096,
                                         use_sliding_window=False), 4096)   # Qwen3: the window is off
    with pytest.raises(UsageError, match="exceeds the target's context of 2048") as err:
        check_extract_length(SimpleNamespace(max_position_embeddings=2048), 4096)
    assert "at most 2048" in err.value.hint and err.value.exit_code == 2
    gemma = SimpleNamespace(max_position_embeddings=131072, sliding_window=1024,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"])
    check_extract_length(gemma, 1024)
    with pytest.raises(UsageError, match="window 1024 tokens") as err:
        check_extract_length(gemma, 2048)
    assert "at most 1024" in err.value.hint
