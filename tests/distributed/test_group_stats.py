"""Whole-group / whole-mini-batch loss statistics do not depend on DP size or micro-batch count.

One 2-rank gloo world runs the actor's first two mini-batches (the second one off-policy, ρ ≠ 1) in
three layouts: TP2 (DP 1) with one or four micro-batches (large / small budget) and TP1 (DP 2) with one
micro-batch per rank. BAPO's bounds (searched at the current policy over the mini-batch) and QUATRO's
dual-ascent λ_q (per prompt, over all its tokens) must be the same in all three; so must the loss.
The per-micro-batch search (official BAPO code, ``bapo.scope='micro_batch'``) is shown to give
other bounds on the same batch, so the check can fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.loss.bapo import bapo_search_bounds
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.params import BapoParams, QuatroParams
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYOUTS = {"dp1_m1": dict(tp=2, budget=512), "dp1_m4": dict(tp=2, budget=24),
           "dp2_m1": dict(tp=1, budget=512)}
LOSSES = {"bapo": LossConfig(method="bapo", bapo=BapoParams(contribution="gradient_mass", target_share=0.6)),
          "quatro": LossConfig(method="quatro", quatro=QuatroParams(dual_solver="dual_ascent"))}


def _run(world: int, layout: dict, loss: LossConfig) -> dict:
    actor = H.build_actor(world, mini_batches=2, **layout)
    actor.loss_cfg = loss
    samples = H.make_samples(n_prompts=4, group=4)
    plans, _, _ = actor.plan(samples)
    actor.old_logprobs.fill(samples, plans)
    out: dict = {"micro_batches": [len(p.micro_batches) for p in plans]}
    for k, plan in enumerate(plans):
        ctx = actor.forward_backward(samples, plan)
        out[f"stats{k}"] = {key: float(v) for key, v in ctx.batch_stats.items()}
        out[f"lambda{k}"] = {s.prompt_index: s.group_stats["quatro/lambda"]
                             for i, s in enumerate(samples) if "quatro/lambda" in s.group_stats}
        out[f"loss{k}"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
        if k == 1 and actor.groups.is_last_stage:  # what a per-micro-batch search would pick
            per_mb = []
            for mb, lp in zip(plan.micro_batches, ctx.logprobs):
                if mb.num_tokens:
                    old = torch.cat([samples[i].old_logprobs for i in mb.sample_index])
                    adv = torch.cat([torch.full((n,), samples[i].advantage)
                                     for i, n in zip(mb.sample_index, mb.resp_lens)])
                    ratio = torch.exp(lp.double() - old.double())
                    every = torch.ones_like(ratio, dtype=torch.bool)
                    per_mb.append(bapo_search_bounds(ratio, adv.double(), every, loss)[:2])
            out["per_micro_batch_bounds"] = per_mb
        actor.optimizer_step(ctx)
    return out


def _worker(rank: int, world: int) -> dict:
    res = {(name, method): _run(world, layout, loss)
           for method, loss in LOSSES.items() for name, layout in LAYOUTS.items()}
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


def test_layouts_have_the_intended_micro_batch_counts(results):
    r = results[0]
    assert r[("dp1_m1", "bapo")]["micro_batches"] == [1, 1]
    assert r[("dp1_m4", "bapo")]["micro_batches"] == [4, 4]
    assert r[("dp2_m1", "bapo")]["micro_batches"] == [1, 1]


@pytest.mark.parametrize("name", ["dp1_m4", "dp2_m1"])
def test_bapo_bounds_same_for_every_layout(results, name):
    for rank_res in results:  # both ranks hold the same bounds
        ref, got = results[0][("dp1_m1", "bapo")], rank_res[(name, "bapo")]
        for k in (0, 1):
            a, b = ref[f"stats{k}"], got[f"stats{k}"]
            assert a["bapo/c_low"] == b["bapo/c_low"] and a["bapo/c_high"] == b["bapo/c_high"], (k, a, b)
            assert math.isclose(a["bapo/pos_share"], b["bapo/pos_share"], rel_tol=1e-6)
            assert math.isclose(ref[f"loss{k}"], got[f"loss{k}"], rel_tol=1e-5, abs_tol=1e-6)
    # off-policy mini-batch: the search moved off its start, so the values are informative
    s1 = results[0][("dp1_m1", "bapo")]["stats1"]
    assert (s1["bapo/c_low"], s1["bapo/c_high"]) != (0.6, 1.2)


def test_per_micro_batch_search_would_differ(results):
    """The official code's per-call search picks other bounds on the same batch (the test can fail)."""
    r = results[0][("dp1_m4", "bapo")]
    mini = (r["stats1"]["bapo/c_low"], r["stats1"]["bapo/c_high"])
    per_mb = [tuple(b) for b in r["per_micro_batch_bounds"]]
    assert len(per_mb) == 4
    assert any(b != mini for b in per_mb), (mini, per_mb)


@pytest.mark.parametrize("name", ["dp1_m4", "dp2_m1"])
def test_quatro_dual_ascent_lambdas_same_for_every_layout(results, name):
    ref = results[0][("dp1_m1", "quatro")]
    for rank_res in results:
        got = rank_res[(name, "quatro")]
        for k in (0, 1):
            mine = got[f"lambda{k}"]
            assert mine, "no λ_q reached the samples"
            for p, lam in mine.items():  # each rank sees its own shard's prompts
                assert math.isclose(lam, ref[f"lambda{k}"][p], rel_tol=1e-5), (k, p, lam)
            assert math.isclose(ref[f"loss{k}"], got[f"loss{k}"], rel_tol=1e-5, abs_tol=1e-6)
    lam1 = ref["lambda1"]
    assert len(set(round(v, 6) for v in lam1.values())) > 1  # per-prompt values, not one constant
