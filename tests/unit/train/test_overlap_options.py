"""Megatron DDP overlap options: on by default where they apply (GPU, dp > 1, distributed optimizer)."""

from __future__ import annotations

import pytest

from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.train.actor.optimizer import overlap_options


def _p(**kw) -> ParallelConfig:
    return ParallelConfig(**{"tp": 2, "world_size": 8, **kw})


@pytest.mark.parametrize("cuda,world,dist_opt,expect", [
    (True, 8, True, (True, True)),     # GPU, dp 4, distributed optimizer: both overlaps
    (True, 8, False, (True, False)),   # no distributed optimizer: nothing to all-gather
    (True, 2, True, (False, False)),   # dp 1: nothing to overlap
    (False, 8, True, (False, False)),  # CPU / gloo: off
])
def test_automatic_defaults(cuda, world, dist_opt, expect):
    got = overlap_options(_p(world_size=world, distributed_optimizer=dist_opt), cuda=cuda)
    assert (got["overlap_grad_reduce"], got["overlap_param_gather"]) == expect


def test_explicit_settings_win():
    got = overlap_options(_p(distributed_optimizer=True, overlap_grad_reduce=False), cuda=True)
    assert got == {"overlap_grad_reduce": False, "overlap_param_gather": False}
    got = overlap_options(_p(overlap_grad_reduce=True), cuda=False)
    assert got == {"overlap_grad_reduce": True, "overlap_param_gather": False}
    got = overlap_options(_p(distributed_optimizer=True, overlap_param_gather=False), cuda=True)
    assert got == {"overlap_grad_reduce": True, "overlap_param_gather": False}


@pytest.mark.parametrize("kw", [{"overlap_param_gather": True},
                                {"overlap_param_gather": True, "distributed_optimizer": True,
                                 "overlap_grad_reduce": False}])
def test_param_gather_overlap_needs_its_prerequisites(kw):
    with pytest.raises(ValueError, match="overlap_param_gather"):
        overlap_options(_p(**kw), cuda=True)
