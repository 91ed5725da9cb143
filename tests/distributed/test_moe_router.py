"""Router configuration on gloo (Qwen3-MoE, EP 2, alltoall): the aux and z losses reach the router's
gradient through Megatron's ``MoEAuxLossAutoScaler`` under our custom RL loss; ``moe/*`` metrics are
reported per step; the router stays fp32 in a bf16 model.

With every advantage 0 the policy-gradient loss has zero gradient, so the router gradient is exactly 0
without a router loss and can only come from the aux / z loss when one is configured.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
from megatron_maspo.parallel.groups import init_parallel
from megatron_maspo.train.components import build_actor
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CASES = {"none": {}, "aux": dict(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.1),
         "seq_aux": dict(moe_load_balancing="seq_aux_loss", moe_aux_loss_coeff=0.1),
         "z": dict(moe_z_loss_coeff=0.1)}


def _case(world: int, fields: dict) -> dict:
    spec = H.qwen3_moe_spec()
    groups = init_parallel(ep=2, seed=11)
    cfg = H.make_cfg(world, ep=2, mini_batches=1)
    for k, v in fields.items():
        setattr(cfg.model, k, v)
    actor = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    samples = H.make_samples()
    for s in samples:
        s.advantage = 0.0
    plans, _, _ = actor.plan(samples)
    actor.old_logprobs.fill(samples, plans)
    actor.forward_backward(samples, plans[0])
    grads = H.full_tensors(actor, grads=True)
    router = {k: v for k, v in grads.items() if k.endswith("router.weight")}
    other = {k: v for k, v in grads.items() if not k.endswith("router.weight")}
    metrics = actor.moe_monitor.collect(groups.tp)
    step = actor.train_step(H.make_samples(seed=1)) if fields.get("moe_aux_loss_coeff") else {}
    return {"router_abs": sum(float(v.abs().sum()) for v in router.values()),
            "other_abs": sum(float(v.abs().sum()) for v in other.values()),
            "n_router": len(router), "metrics": metrics, "step": step,
            "cfg_keys": {k: getattr(actor.chunks[0].config, k) for k in
                         ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff")}}


def _bf16_router() -> dict:
    spec = H.qwen3_moe_spec()
    init_parallel(ep=1, seed=11)
    out = {}
    for keep in (True, False):
        (m,) = build_model_chunks(spec, ModelBuildOptions(bf16=True, params_dtype=torch.bfloat16,
                                                          moe_router_fp32=keep), pp_rank=0)
        dtypes = {n: p.dtype for n, p in m.named_parameters()}
        out[keep] = ({d for n, d in dtypes.items() if "router" in n},
                     {d for n, d in dtypes.items() if "router" not in n}, m.config.moe_router_dtype)
    return out


def _worker(rank: int, world: int) -> dict:
    res = {name: _case(world, f) for name, f in CASES.items()}
    return res if rank == 0 else {}


def _bf16_worker(rank: int, world: int) -> dict:
    return _bf16_router()


@pytest.fixture(scope="module")
def res() -> dict:
    return run_workers(_worker, 2)[0]


def test_router_gradient_comes_only_from_router_losses(res):
    for name in CASES:
        assert res[name]["n_router"] == 2, name
    # zero advantages: no policy gradient at all without a router loss
    assert res["none"]["router_abs"] == 0.0 and res["none"]["other_abs"] == 0.0
    for name in ("aux", "seq_aux", "z"):
        assert res[name]["router_abs"] > 1e-6, name
        assert res[name]["other_abs"] > 0.0, name  # the router's input depends on every layer below


def test_router_config_reaches_megatron(res):
    assert res["none"]["cfg_keys"] == {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
                                       "moe_z_loss_coeff": None}
    assert res["seq_aux"]["cfg_keys"]["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert res["z"]["cfg_keys"]["moe_z_loss_coeff"] == 0.1


def test_moe_metrics_per_step(res):
    for name in CASES:
        m = res[name]["metrics"]
        for k in ("moe/load_imbalance", "moe/dropped_frac", "moe/router_entropy"):
            assert k in m, (name, k)
            assert name not in ("aux", "seq_aux") or k in res[name]["step"], (name, k)
        assert m["moe/load_imbalance"] >= 1.0 and m["moe/dropped_frac"] == 0.0  # no capacity factor
        assert 0.0 < m["moe/router_entropy"] <= math.log(4) + 1e-9
    assert "moe/aux_loss" not in res["none"]["metrics"] and "moe/z_loss" not in res["none"]["metrics"]
    # Switch aux loss E·Σ f_i·P_i / topk (1 when balanced and uniform), reported without its coefficient
    assert 0.5 < res["aux"]["metrics"]["moe/aux_loss"] < 4.0
    assert res["seq_aux"]["metrics"]["moe/aux_loss"] > 0.0
    assert 0.5 < res["aux"]["step"]["moe/aux_loss"] < 4.0
    assert res["z"]["metrics"]["moe/z_loss"] > 0.0 and "moe/aux_loss" not in res["z"]["metrics"]


def test_bf16_model_keeps_router_fp32():
    out = run_workers(_bf16_worker, 1)[0]
    router, rest, dtype = out[True]
    assert router == {torch.float32} and rest == {torch.bfloat16} and dtype == "fp32"
    router, rest, dtype = out[False]
    assert router == {torch.bfloat16} and dtype is None
