"""TP x EP for MoE on gloo: tensor parallelism (with sequence parallelism on the local spec's torch norms,
``model/sp_norm.py``) combined with expert parallelism gives the single-rank log-probs, loss, gradients
and step for Qwen3-MoE (softmax router) and a GLM-4.5 / DeepSeek-V3-style MoE (sigmoid router with a
correction bias, group-limited top-k, routed scaling factor, shared expert, a dense first layer,
partial rotary, QKV bias, q/k norm).

The 4-rank layout is TP 2 x EP 2 (dense DP 2, expert DP 1); sequence parallelism comes on by default
(``parallel.sequence_parallel=None`` resolves to True for MoE at TP > 1).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers
from tests.distributed.test_actor import _close, _close_after_adam, _moe_procedure

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def glm_style_spec():
    """A tiny GLM-4.5-style MoE: every DeepSeekMoE router feature on, 2 layers (the first dense)."""
    return dataclasses.replace(
        H.qwen3_moe_spec(), family="glm4_moe", num_moe_experts=8, moe_router_topk=4, add_qkv_bias=True,
        rotary_percent=0.5, moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
        moe_router_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_first_k_dense=1)


SPECS = {"qwen3_moe": H.qwen3_moe_spec, "glm4_moe": glm_style_spec}


def _set_biases(actor) -> None:
    """Non-zero correction biases (a function of the global name), so that selection depends on them."""
    for c in actor.chunks:
        for n, b in c.module.named_buffers():
            if n.endswith("router.expert_bias"):
                g = torch.Generator().manual_seed(zlib.crc32(H.global_name(n, actor.groups, actor.spec).encode()))
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _worker(rank: int, world: int, tp: int, ep: int) -> dict:
    res = {}
    for name, make in SPECS.items():
        actor = H.build_actor(world, tp=tp, ep=ep, spec=make())
        _set_biases(actor)
        before = [b.clone() for c in actor.chunks for n, b in c.module.named_buffers() if n.endswith("expert_bias")]
        res[name] = _moe_procedure(actor)
        res[name]["bias_before"] = before
        res[name]["sp"] = actor.opts.sequence_parallel
        res[name]["bias"] = [b.detach().clone() for c in actor.chunks for n, b in c.module.named_buffers()
                             if n.endswith("router.expert_bias")]
    return res if rank == 0 else {}


@pytest.mark.slow  # 1 + 4 ranks, two models: ~40 s on 2 cores
def test_tp2_ep2_matches_one_rank():
    one = run_workers(_worker, 1, 1, 1)[0]
    four = run_workers(_worker, 4, 2, 2)[0]
    for name in SPECS:
        r1, r4 = one[name], four[name]
        assert (r1["sp"], r4["sp"]) == (False, True), name
        assert r1["first_dev"] == 0.0 and r4["first_dev"] == 0.0, name
        for x, y in zip(r4["lp"], r1["lp"]):
            assert torch.allclose(x, y, atol=2e-6), (name, (x - y).abs().max())
        assert math.isclose(r4["loss"], r1["loss"], rel_tol=1e-5, abs_tol=1e-6), name
        _close(r4["grads"], r1["grads"], atol=1e-6)
        assert r4["step"]["actor/step_skipped"] == 0.0
        assert math.isclose(r4["step"]["actor/grad_norm"], r1["step"]["actor/grad_norm"], rel_tol=1e-5), name
        _close_after_adam(r4["params"], r1["params"], r1["grads"])
    # the correction bias exists (glm) and stayed frozen through the step (the default), bit for bit
    for r in (one["glm4_moe"], four["glm4_moe"]):
        assert r["bias"] and all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(r["bias"], r["bias_before"]))
