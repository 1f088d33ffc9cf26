"""`train --init-from EXPORT`: a drafter starts from an earlier export's weights (another pass, more data)."""

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipe.config import RunConfig, normalize
from dflash_pipe.errors import ValidationError
from dflash_pipe.train.trainer import run_train
from tests.cache_helpers import write_train_cache


def _cfg(cache, out, **train):
    cfg = RunConfig()
    cfg.train.cache_dir, cfg.train.output_dir = str(cache), str(out)
    cfg.drafter.num_layers, cfg.drafter.block_size = 1, 4
    cfg.train.context_tokens, cfg.train.num_anchors, cfg.train.lr = 96, 8, 3e-3
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _weights(out):
    return load_file(str(out / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A cache and a drafter trained on it for one epoch (the export --init-from starts from)."""
    d = tmp_path_factory.mktemp("init_from")
    write_train_cache(d / "cache", num_docs=12, seed=5)
    run_train(normalize(_cfg(d / "cache", d / "first")))
    return d


def test_init_from_starts_at_the_exports_weights(trained, capsys):
    first = _weights(trained / "first")
    # lr 1e-30: no step moves an fp32 weight (an update of ~1e-30 is far under its ulp), so the new export is
    # its starting point, to the bit
    run_train(normalize(_cfg(trained / "cache", trained / "again", lr=1e-30, seed=1,
                             init_from=str(trained / "first" / "export"))))
    assert "weights from" in capsys.readouterr().out
    again = _weights(trained / "again")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    # the control: the same run without --init-from keeps its random init, not the trained weights
    run_train(normalize(_cfg(trained / "cache", trained / "fresh", lr=1e-30, seed=1)))
    fresh = _weights(trained / "fresh")
    assert not all(torch.equal(fresh[k], first[k]) for k in first)


def test_init_from_continues_training(trained):
    """A second pass from the export reaches a lower first-step loss than the first run's first step."""
    import json

    run_train(normalize(_cfg(trained / "cache", trained / "second", seed=2,
                             init_from=str(trained / "first" / "export"))))
    loss0 = {p: json.loads((trained / p / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for p in ("first", "second")}
    assert loss0["second"] < loss0["first"]


def test_init_from_refuses_another_drafter_shape_and_a_missing_export(trained):
    cfg = _cfg(trained / "cache", trained / "wide", init_from=str(trained / "first" / "export"))
    cfg.drafter.num_layers = 2
    with pytest.raises(ValidationError) as err:
        run_train(normalize(cfg))
    assert "num_layers: export 1 vs this run 2" in str(err.value) and err.value.exit_code == 3
    assert not (trained / "wide" / "export").exists()
    missing = _cfg(trained / "cache", trained / "nowhere", init_from=str(trained / "no-such-export"))
    with pytest.raises(Exception) as err:
        run_train(normalize(missing))
    assert "no-such-export" in str(err.value) and "model.safetensors" in str(err.value)


def test_a_resumed_checkpoint_wins_over_init_from(trained, capsys):
    import shutil

    shutil.copytree(trained / "first", trained / "resumed")
    run_train(normalize(_cfg(trained / "cache", trained / "resumed",
                             init_from=str(trained / "no-such-export"))))   # resumes: the export is not read
    assert "--init-from ignored (resumed)" in capsys.readouterr().out
