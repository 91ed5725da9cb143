"""Megatron's torch-AdamW fallback runs PyTorch's fused kernel (plain and distributed optimizer), and
an update with it equals the per-tensor loop's; the sum-based finiteness check still catches NaN/inf."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.train.actor.optimizer import grads_finite, prefer_fused_adam
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers
from tests.distributed.test_actor import _close_after_adam

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inner(actor) -> list:
    return [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
            if o.optimizer is not None]


def _step(world: int, fused: bool, **layout) -> dict:
    actor = H.build_actor(world, mini_batches=1, **layout)
    inner = _inner(actor)
    out = {"fused_after_build": [g["fused"] for o in inner for g in o.param_groups]}
    if not fused:  # back to Megatron's plain fallback: the reference
        for o in inner:
            for g in (o.defaults, *o.param_groups):
                g["fused"], g["foreach"] = None, None
    out["switched_again"] = prefer_fused_adam(actor.optimizer) if fused else 0
    samples = H.make_samples(seed=5)
    out["metrics"] = actor.train_step(samples)
    out["grads"] = H.full_tensors(actor, grads=True)
    out["params"] = H.full_tensors(actor, grads=False)
    # finiteness: a single NaN / inf anywhere in a gradient buffer is found
    buf = actor.chunks[0].buffers[0].grad_data
    keep = buf[3].clone()
    out["finite"] = [grads_finite(actor.chunks)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        buf[3] = bad
        out["finite"].append(grads_finite(actor.chunks))
    buf[3] = keep
    return out


def _worker(rank: int, world: int, layout: dict) -> dict:
    res = {fused: _step(world, fused, **layout) for fused in (True, False)}
    return res if rank == 0 else {}


@pytest.mark.parametrize("world,layout", [
    (1, {}), pytest.param(2, {"dist_opt": True}, marks=pytest.mark.slow)])
def test_fused_adam_matches_the_per_tensor_loop(world, layout):
    res = run_workers(_worker, world, layout)[0]
    fused, plain = res[True], res[False]
    assert fused["fused_after_build"] and all(fused["fused_after_build"])
    assert fused["switched_again"] >= 1
    assert fused["finite"] == [True, False, False, False]
    assert fused["metrics"]["actor/loss"] == plain["metrics"]["actor/loss"]
    for k in plain["grads"]:
        torch.testing.assert_close(fused["grads"][k], plain["grads"][k], atol=0, rtol=0)
    _close_after_adam(fused["params"], plain["params"], plain["grads"])
