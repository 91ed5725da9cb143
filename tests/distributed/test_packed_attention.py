"""Packed SDPA attention == the dense block-causal-mask path through the whole actor, on gloo.

For TP 1 (1 rank), TP 2 and PP 2 (2 ranks) the actor is built twice with the same weights, once per
``model.attention_backend``, and runs the log-prob recompute and one MASPO forward+backward on the
same packed micro-batches (several sequences of unequal length per row). Loss, log-probs and every
parameter gradient must agree to 1e-5 relative in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BACKENDS = ("dense_mask", "packed_sdpa")


def _one(world: int, backend: str, tp: int = 1, pp: int = 1) -> dict:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    cfg = H.make_cfg(world, tp, pp, budget=72)
    cfg.model.attention_backend = backend
    spec = H.qwen2_spec()
    groups = init_parallel(tp=tp, pp=pp, seed=11)
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


def _dropout() -> dict:
    """Attention dropout in training mode, through Megatron's model-parallel RNG tracker."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_maspo.model.packed_attention import PackedSDPAttention, build_packed_seq_params

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.5, use_cpu_initialization=True)
    m = PackedSDPAttention(cfg, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 8, generator=g) for h in (4, 2, 2))
    params = build_packed_seq_params([0, 10, 24])
    out = {"eval": m.eval()(q, k, v, None, packed_seq_params=params)}
    m.train()
    out["train1"] = m(q, k, v, None, packed_seq_params=params)
    out["train2"] = m(q, k, v, None, packed_seq_params=params)
    m.dropout_p = 0.0
    out["train_p0"] = m(q, k, v, None, packed_seq_params=params)
    return out


def _worker(rank: int, world: int, layouts: dict) -> dict:
    res = {name: {b: _one(world, b, **lay) for b in BACKENDS} for name, lay in layouts.items()}
    if world == 1:
        res["dropout"] = _dropout()
    return res if rank == 0 else {}


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_workers(_worker, 1, {"tp1": {}})[0]
    out.update(run_workers(_worker, 2, {"tp2": {"tp": 2}, "pp2": {"pp": 2}})[0])
    return out


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_packed_sdpa_matches_dense_mask(results, layout):
    dense, packed = results[layout]["dense_mask"], results[layout]["packed_sdpa"]
    # the rows really are packed: several sequences of unequal length in one micro-batch
    assert any(len(lens) >= 3 and len(set(lens)) >= 2 for lens in packed["seq_lens"])
    assert packed["seq_lens"] == dense["seq_lens"]
    assert math.isclose(packed["loss"], dense["loss"], rel_tol=1e-5, abs_tol=1e-7)
    for x, y in zip(packed["lp"], dense["lp"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert packed["grads"].keys() == dense["grads"].keys()
    for name, g in dense["grads"].items():
        assert g.abs().max() > 0, f"reference gradient of {name} is zero: the check would be vacuous"
        err = (packed["grads"][name] - g).abs().max() / g.abs().max()
        assert err < 1e-5, f"{layout} {name}: max relative gradient error {err:.2e}"


def test_layouts_agree_with_each_other(results):
    """TP2 and PP2 on the packed path also reproduce the single-rank packed run."""
    ref = results["tp1"]["packed_sdpa"]
    for layout in ("tp2", "pp2"):
        got = results[layout]["packed_sdpa"]
        assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-7)
        for name, g in ref["grads"].items():
            err = (got["grads"][name] - g).abs().max() / g.abs().max()
            assert err < 1e-5, f"{layout} {name}: {err:.2e}"


def test_attention_dropout_is_applied_in_training_only(results):
    d = results["dropout"]
    assert not torch.allclose(d["train1"], d["eval"])  # dropped out in training
    assert not torch.allclose(d["train1"], d["train2"])  # a fresh mask per call
    torch.testing.assert_close(d["train_p0"], d["eval"])
