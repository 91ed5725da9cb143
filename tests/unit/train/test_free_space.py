"""The free space checked before training follows the model (not a fixed 64 MiB) and
``checkpoint.min_free_mb`` overrides it (real configs and folders)."""

from __future__ import annotations

import pytest

from megatron_maspo.errors import ConfigError
from megatron_maspo.recipes.registry import resolve_config


def _cfg(*sets: str):
    return resolve_config(None, None, list(sets))


def test_the_free_space_needed_follows_the_model_and_the_setting(tmp_path):
    from megatron_maspo.train.preflight import free_bytes_needed

    small, big = _cfg("model.tiny_hidden_size=32"), _cfg("model.tiny_hidden_size=256")
    assert free_bytes_needed(small, []) < free_bytes_needed(big, [])  # not a fixed 64 MiB any more
    # the estimate covers what a real tiny checkpoint takes: weights + Adam moments (+ metadata)
    assert free_bytes_needed(small, []) >= 16 * 2**20
    assert free_bytes_needed(_cfg("checkpoint.min_free_mb=3"), []) == 3 * 2**20
    last = tmp_path / "step_2"
    last.mkdir()
    (last / "shard").write_bytes(b"x" * 1000)
    assert free_bytes_needed(small, [last]) == 1000  # a resume: the last checkpoint's size
    with pytest.raises(ConfigError, match="checkpoint.min_free_mb must be >= 0"):
        _cfg("checkpoint.min_free_mb=-1")
