"""Context parallelism through the whole actor (gloo): cp = 2 == cp = 1 on the same rollout batch.

The actor is built with name-keyed weights (identical at every layout) and runs the log-prob
recompute and one MASPO forward+backward of a mini-batch whose sequences do not divide into 2·cp
chunks (uneven prompt and response lengths; packing pads each one). Log-probs, the loss and every
parameter gradient must agree with the single-rank run to 1e-5 relative in fp32. The budget counts
tokens per CP rank, so cp = 2 at half the budget packs rows of the same length as cp = 1.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BUDGET = 72  # tokens per row at cp = 1; cp = 2 gets BUDGET / 2 per rank


def _one(world: int, *, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, moe: bool = False) -> dict:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    cfg = H.make_cfg(world, tp, pp, ep, budget=BUDGET // cp)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=cp))
    spec = H.qwen3_moe_spec() if moe else H.qwen2_spec()
    groups = init_parallel(tp=tp, pp=pp, ep=ep, cp=cp, seed=11)
    actor = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    samples = H.make_samples()
    plans, _, _ = actor.plan(samples)
    out: dict = {"seq_lens": [mb.seq_lens for p in plans for mb in p.micro_batches]}
    out["lp"] = actor.compute_logprobs(samples)[0]
    actor.old_logprobs.fill(samples, plans)
    ctx = actor.forward_backward(samples, plans[0])
    out["loss"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
    out["grads"] = H.full_tensors(actor, grads=True)
    return out


def _worker(rank: int, world: int, layouts: dict) -> dict:
    res = {name: _one(world, **lay) for name, lay in layouts.items()}
    return res if rank == 0 else {}


def _compare(got: dict, ref: dict, name: str) -> None:
    assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-7), name
    assert len(got["lp"]) == len(ref["lp"])
    for x, y in zip(got["lp"], ref["lp"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == ref["grads"].keys()
    zero = [k for k, g in ref["grads"].items() if g.abs().max() == 0]
    # an expert no token was routed to has no gradient (nor may it get one from CP's padding)
    assert all("local_experts" in k for k in zero), f"zero reference gradients: {zero}"
    assert len(zero) < len(ref["grads"]) // 4
    for key, g in ref["grads"].items():
        scale = g.abs().max() if key not in zero else 1.0
        err = (got["grads"][key] - g).abs().max() / scale
        assert err < 1e-5, f"{name} {key}: max relative gradient error {err:.2e}"


@pytest.fixture(scope="module")
def dense() -> dict:
    out = run_workers(_worker, 1, {"cp1": {}})[0]
    out.update(run_workers(_worker, 2, {"cp2": {"cp": 2}})[0])
    return out


def test_cp2_dense_matches_cp1(dense):
    # sequences were padded: some packed lengths of cp = 1 are not multiples of 4
    assert any(n % 4 for lens in dense["cp1"]["seq_lens"] for n in lens)
    assert all(n % 4 == 0 for lens in dense["cp2"]["seq_lens"] for n in lens)
    _compare(dense["cp2"], dense["cp1"], "cp2")


@pytest.fixture(scope="module")
def composed() -> dict:
    """CP composed with TP and PP (4 ranks), against the same single-rank reference."""
    out = run_workers(_worker, 1, {"cp1": {}})[0]
    out.update(run_workers(_worker, 4, {"cp2tp2": {"cp": 2, "tp": 2}, "cp2pp2": {"cp": 2, "pp": 2}})[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2tp2", "cp2pp2"])
def test_cp2_composes_with_tp_and_pp(composed, layout):
    _compare(composed[layout], composed["cp1"], layout)


@pytest.fixture(scope="module")
def moe() -> dict:
    """A tiny MoE model: CP 2 alone and CP 2 x EP 2 (experts laid over the two CP ranks)."""
    out = run_workers(_worker, 1, {"cp1": {"moe": True}})[0]
    out.update(run_workers(_worker, 2, {"cp2": {"cp": 2, "moe": True},
                                        "cp2ep2": {"cp": 2, "ep": 2, "moe": True}})[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "cp2ep2"])
def test_cp2_moe_matches_cp1(moe, layout):
    _compare(moe[layout], moe["cp1"], layout)
