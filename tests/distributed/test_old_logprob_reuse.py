"""One mini-batch per step: the old-log-prob recompute is skipped and the training forward's detached
log-probs stand in; loss, gradients, updated weights and the stored old log-probs equal the
recompute path (``train.check_first_ratio=True`` keeps it) at 1 rank and at TP2 / PP2, with and
without a KL term (PP2 and the other combinations: ``slow``). With two mini-batches the recompute
always runs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_maspo.parallel.groups import init_parallel
from megatron_maspo.train.actor.megatron_actor import MegatronActor
from megatron_maspo.train.components import build_actor
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers
from tests.distributed.test_actor import _close_after_adam

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _actor(world: int, *, recompute: bool, kl: float = 0.0, mini_batches: int = 1,
           **layout) -> MegatronActor:
    spec = H.qwen2_spec()
    groups = init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), seed=11)
    cfg = H.make_cfg(world, mini_batches=mini_batches, check_first_ratio=recompute,
                     reference_model=kl > 0, **layout)
    cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, kl_coef=kl))
    return build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))


def _run(actor: MegatronActor) -> dict:
    """One ``train_step`` (the real path), counting policy log-prob passes; grads of its mini-batch."""
    calls = []
    inner = actor.logprobs_local

    def counting(samples, plans, *, model):
        calls.append(model)
        return inner(samples, plans, model=model)

    actor.logprobs_local = counting
    samples = H.make_samples(seed=4)
    m = actor.train_step(samples)
    old = [s.old_logprobs for s in samples]
    return {"metrics": m, "passes": calls, "grads": H.full_tensors(actor, grads=True),
            "params": H.full_tensors(actor, grads=False),
            "has_old": [o is not None for o in old],
            "old": [o for o in old if o is not None]}


def _worker(rank: int, world: int, layouts: dict, two_mb: bool) -> dict:
    """``layouts``: name -> (layout kwargs, KL coefficients to run)."""
    res = {}
    for name, (layout, kls) in layouts.items():
        for kl in kls:
            for recompute in (False, True):
                res[(name, kl, recompute)] = _run(_actor(world, recompute=recompute, kl=kl, **layout))
    if two_mb:
        res["two_mb"] = _run(_actor(world, recompute=False, mini_batches=2))
    return res if rank == 0 else {}


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_workers(_worker, 1, {"1x1": ({}, (0.0, 0.05))}, True)[0]


@pytest.fixture(scope="module")
def two_rank() -> dict:
    return run_workers(_worker, 2, {"tp2": ({"tp": 2}, (0.05,))}, True)[0]


@pytest.fixture(scope="module")
def two_rank_slow() -> dict:
    return run_workers(_worker, 2, {"pp2": ({"pp": 2}, (0.0, 0.05)), "tp2": ({"tp": 2}, (0.0,))},
                       False)[0]


def _same(a: dict, b: dict, *, grad_atol: float) -> None:
    for k in ("actor/loss", "actor/grad_norm", "actor/loss_mb0"):
        assert math.isclose(a["metrics"][k], b["metrics"][k], rel_tol=1e-5, abs_tol=1e-7), k
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        torch.testing.assert_close(a["grads"][k], b["grads"][k], atol=grad_atol, rtol=1e-5)
    # one Adam step: tight where the gradient is informative (see test_actor._close_after_adam)
    _close_after_adam(a["params"], b["params"], b["grads"])


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_reuse_equals_recompute_at_one_rank(one_rank, kl):
    skip, full = one_rank[("1x1", kl, False)], one_rank[("1x1", kl, True)]
    assert full["passes"] == ["policy"] + (["reference"] if kl else [])
    assert skip["passes"] == (["reference"] if kl else [])  # no policy recompute
    assert skip["metrics"]["actor/first_ratio_max_abs_dev"] == 0.0
    assert full["metrics"]["actor/first_ratio_max_abs_dev"] <= 1e-6
    _same(skip, full, grad_atol=1e-7)
    # the old log-probs the trainer reads afterwards (mismatch diagnostics) are filled either way
    assert all(skip["has_old"]) and len(skip["old"]) == len(full["old"])
    for a, b in zip(skip["old"], full["old"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _check_two_ranks(res: dict, ref: dict, layout: str, kl: float) -> None:
    skip, full = res[(layout, kl, False)], res[(layout, kl, True)]
    assert "policy" not in skip["passes"] and "policy" in full["passes"]
    _same(skip, full, grad_atol=1e-7)
    _same(skip, ref[("1x1", kl, True)], grad_atol=1e-6)


def test_reuse_matches_recompute_and_reference_at_tp2(one_rank, two_rank):
    _check_two_ranks(two_rank, one_rank, "tp2", 0.05)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kl", [("pp2", 0.0), ("pp2", 0.05), ("tp2", 0.0)])
def test_reuse_matches_recompute_and_reference_slow(one_rank, two_rank_slow, layout, kl):
    _check_two_ranks(two_rank_slow, one_rank, layout, kl)


def test_two_mini_batches_keep_the_recompute(one_rank, two_rank):
    for r in (one_rank["two_mb"], two_rank["two_mb"]):
        assert r["passes"] == ["policy"]
        assert r["metrics"]["actor/first_ratio_max_abs_dev"] <= 1e-6
