"""The planner's MoE token all-to-all (launch/plan/moe_comm.py): zero where there is none, its scaling,
dense first layers, the link, a hand-computed case and its place in the trainer's step time."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.moe_comm import (
    a2a_bytes,
    a2a_seconds,
    moe_layers_on_busiest_stage,
    offnode_peer_fraction,
)
from megatron_maspo.launch.plan.types import Layout
from megatron_maspo.model.presets import get_preset
from megatron_maspo.recipes.registry import load_recipe

NO_LATENCY = Assumptions(p2p_latency_us=0.0)


def test_zero_for_dense_models_and_without_expert_parallelism():
    dense = get_preset("qwen3-32b")
    assert a2a_seconds(dense, Layout(tp=1, pp=1, ep=8), 1e6, 2, Assumptions(), 8, micro_batches=4) == (0.0, 0.0)
    moe = get_preset("qwen3-30b-a3b")
    assert a2a_seconds(moe, Layout(tp=1, pp=1, ep=1), 1e6, 2, Assumptions(), 8, micro_batches=4) == (0.0, 0.0)
    assert a2a_seconds(moe, Layout(tp=1, pp=1, ep=8), 1e6, 2, Assumptions(), 8)[0] > 0


def test_bytes_scale_with_the_share_sent_off_gpu_and_with_top_k():
    spec = get_preset("qwen3-30b-a3b")
    at = {ep: a2a_seconds(spec, Layout(tp=1, pp=1, ep=ep), 1e6, 2, NO_LATENCY, 8)[0] for ep in (2, 4, 8)}
    assert at[4] / at[2] == pytest.approx((3 / 4) / (1 / 2))
    assert at[8] / at[2] == pytest.approx((7 / 8) / (1 / 2))
    half_k = dataclasses.replace(spec, moe_router_topk=spec.moe_router_topk // 2)
    assert a2a_seconds(half_k, Layout(tp=1, pp=1, ep=8), 1e6, 2, NO_LATENCY, 8)[0] == pytest.approx(at[8] / 2)
    # the tokens a GPU dispatches are its TP (sequence-parallel) and CP share of the replica's
    split = a2a_seconds(spec, Layout(tp=2, pp=1, ep=8, cp=2), 1e6, 2, NO_LATENCY, 8)[0]
    assert split == pytest.approx(at[8] / 4)
    assert a2a_bytes(10, 2, 100, 2, 4) == 10 * 2 * 100 * 2 * 3 / 4


def test_dense_first_layers_have_no_all_to_all():
    ds = get_preset("deepseek-v3")  # 3 dense layers, then 58 MoE layers of 61
    assert (ds.num_layers, ds.moe_first_k_dense) == (61, 3)
    assert moe_layers_on_busiest_stage(ds, 1) == 58
    all_moe = dataclasses.replace(ds, moe_first_k_dense=0)
    lay = Layout(tp=1, pp=1, ep=8)
    got = a2a_seconds(ds, lay, 1e6, 2, Assumptions(), 8, micro_batches=3)
    full = a2a_seconds(all_moe, lay, 1e6, 2, Assumptions(), 8, micro_batches=3)
    assert got[0] == pytest.approx(full[0] * 58 / 61) and got[1] == pytest.approx(full[1] * 58 / 61)
    # stages of ceil(61 / 4) = 16 layers: the first holds 13 MoE layers, the others 16, 16 and 13
    assert moe_layers_on_busiest_stage(ds, 4) == 16


def test_inter_node_peers_are_slower_than_nvlink_for_the_same_bytes():
    assert offnode_peer_fraction(8, 8) == 0.0 and offnode_peer_fraction(4, 8) == 0.0
    assert offnode_peer_fraction(16, 8) == 8 / 15  # 8 of a rank's 15 peers sit on the other node
    # groups of 3 straddle node boundaries: in ranks 6-8, rank 8's two peers are both on the other node
    assert offnode_peer_fraction(3, 8) == 1.0
    spec = get_preset("qwen3-30b-a3b")
    lay = Layout(tp=1, pp=1, ep=16)
    one_node = a2a_seconds(spec, lay, 1e6, 2, Assumptions(), 16)
    two_nodes = a2a_seconds(spec, lay, 1e6, 2, Assumptions(), 8)
    assert two_nodes[0] > one_node[0] and two_nodes[1] > one_node[1]


def test_hand_computed_case():
    spec = get_preset("qwen3-30b-a3b")
    assert (spec.num_layers, spec.hidden_size, spec.moe_router_topk, spec.moe_first_k_dense) == (48, 2048, 8, 0)
    # 8192 tokens per GPU, 8 copies each, 2048 x 2 bytes, 7 of 8 copies leave the GPU: 234,881,024 bytes
    # per dispatch (and per combine), over NVLink at 150 GB/s; 3 collectives x 2 micro-batches x 20 us
    move = 8192 * 8 * 2048 * 2 * 7 / 8 / 150e9
    want = 48 * (2 * move + 3 * 2 * 20e-6)
    got = a2a_seconds(spec, Layout(tp=1, pp=1, ep=8), 8192, 2, Assumptions(), 8, micro_batches=2)
    assert got == (want, want)
    assert want == pytest.approx(0.15608385536)
    # the same on two nodes (EP 16): 8 of 15 peers off-node at 40 GB/s dominate the 7 on NVLink
    b16 = 8192 * 8 * 2048 * 2 * 15 / 16
    want16 = 48 * (2 * max(b16 * 7 / 15 / 150e9, b16 * 8 / 15 / 40e9) + 3 * 2 * 20e-6)
    got16 = a2a_seconds(spec, Layout(tp=1, pp=1, ep=16), 8192, 2, Assumptions(), 8, micro_batches=2)
    assert got16[0] == pytest.approx(want16, rel=1e-12)


def test_the_trainer_pays_the_all_to_all_once_per_forward_and_once_per_backward():
    cfg = load_recipe("qwen3_30b_a3b_maspo")
    spec, lay = arch_of(cfg), layout_of(cfg)
    assert lay.ep > 1 and lay.recompute == "full"
    slow = estimate(cfg, spec, lay, nodes=4, gpus_per_node=8, hw=Assumptions()).time
    free = estimate(cfg, spec, lay, nodes=4, gpus_per_node=8,
                    hw=Assumptions(nvlink_gb_s=1e12, internode_gb_s=1e12, p2p_latency_us=0.0)).time
    a2a = slow.old_logprob - free.old_logprob
    assert a2a > 0 and slow.generation == free.generation
    passes = 2 if (cfg.train.reference_model or cfg.loss.kl_coef > 0) else 1  # actor (+ reference) forward
    # update: forward, recomputed forward, backward: three all-to-all passes
    assert slow.update - free.update == pytest.approx(3 * a2a / passes, rel=1e-6)
