"""``screen_checkpoint_once`` on 2 gloo ranks: rank 0 screens, every rank gets its verdict; a hostile bytes
item is refused on both ranks with the same line, and no code runs (real torch checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._launch import run_workers


def _screen(rank: int, world: int, folder: str) -> str | None:
    from megatron_maspo.errors import InputError
    from megatron_maspo.model.safe_load import screen_checkpoint_once

    try:
        screen_checkpoint_once(Path(folder))
    except InputError as e:
        return str(e)
    return None


def _checkpoint(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.randn(3, 4), "extra": [None]}, checkpoint_id=str(folder))


def test_every_rank_gets_rank_0s_verdict(tmp_path):
    from tests.hostile import plant_in_bytes_item

    _checkpoint(tmp_path / "ok")
    assert run_workers(_screen, 2, str(tmp_path / "ok")) == [None, None]
    _checkpoint(tmp_path / "bad")
    marker = tmp_path / "ran"
    shard, key = plant_in_bytes_item(tmp_path / "bad", marker)
    verdicts = run_workers(_screen, 2, str(tmp_path / "bad"))
    assert verdicts[0] == verdicts[1] and verdicts[0].startswith(f"{shard}: bytes item {key!r}: refused")
    assert not marker.exists()
