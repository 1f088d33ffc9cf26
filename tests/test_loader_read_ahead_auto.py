"""`[train] loader_read_ahead = -1` (the default) resolves by where the cache lives."""
from dflash_pipe.config import TrainConfig
from dflash_pipe.train.loader import READ_AHEAD_LOCAL, READ_AHEAD_REMOTE, auto_read_ahead


def test_auto_read_ahead_is_deeper_on_object_storage_and_explicit_values_stay():
    assert TrainConfig().loader_read_ahead == -1
    assert auto_read_ahead(-1, local=True) == READ_AHEAD_LOCAL == 4
    assert auto_read_ahead(-1, local=False) == READ_AHEAD_REMOTE == 8
    for n in (0, 2, 4, 16):
        assert auto_read_ahead(n, local=False) == n and auto_read_ahead(n, local=True) == n
