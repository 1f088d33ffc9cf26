"""Default target layer ids (SPEC §2) and layer-id validation."""

from __future__ import annotations

import pytest

from dflash_pipe.errors import UsageError
from dflash_pipe.target import default_target_layer_ids, validate_layer_ids


def test_spec_examples():
    assert default_target_layer_ids(5, 36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(5, 64) == [1, 16, 31, 46, 61]


@pytest.mark.parametrize("L", [1, 2, 7, 30, 36, 64])
def test_single_layer_is_the_middle(L):
    assert default_target_layer_ids(1, L) == [L // 2]


@pytest.mark.parametrize("n,L", [(2, 8), (3, 30), (5, 8), (4, 48), (6, 64)])
def test_rule_against_direct_formula(n, L):
    ids = default_target_layer_ids(n, L)
    assert ids == [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    assert ids[0] == 1 and ids[-1] == L - 3 and ids == sorted(set(ids))


def test_rule_refuses_too_shallow_targets():
    with pytest.raises(UsageError, match="cannot spread"):
        default_target_layer_ids(5, 4)
    with pytest.raises(UsageError):
        default_target_layer_ids(0, 36)


@pytest.mark.parametrize("ids,msg", [([], "empty"), ([0, 36], "out of range"), ([-1], "out of range"),
                                     ([3, 3], "duplicates"), ([5, 2], "increasing"), ([1.0], "integers"),
                                     ([True], "integers")])
def test_validate_refuses(ids, msg):
    with pytest.raises(UsageError, match=msg):
        validate_layer_ids(ids, 36)


def test_validate_accepts_and_returns_list():
    assert validate_layer_ids((0, 17, 35), 36) == [0, 17, 35]
