"""Planner: figures against hand computations, refusals with reasons, suggestions, and the CLI."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import (
    GIB,
    Assumptions,
    Layout,
    apply_layout,
    arch_of,
    estimate,
    layout_of,
    suggest,
)
from megatron_maspo.recipes.registry import load_recipe


def test_dense_7b_memory_and_time_match_hand_computation():
    """r1_distill_qwen_7b_maspo on 4 x 8 H100-80G: TP 2, DP 16, full recompute, distributed optimizer."""
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
    assert plan.fits and plan.dp == 16
    h, nh, g, d, f, v, layers, t = 3584, 28, 4, 128, 18944, 152064, 28, 2  # V is already a multiple of 256
    attn = (h * nh * d + 2 * h * g * d + nh * d * h + nh * d + 2 * g * d) / t
    per_layer = attn + 3 * h * f / t + 2 * h
    p_local = layers * per_layer + 2 * v * h / t + h  # untied: embedding + output layer, final norm
    m = plan.memory
    assert m.weights == pytest.approx(p_local * 2 / GIB)
    assert m.grads == pytest.approx(p_local * 4 / GIB)
    assert m.optimizer == pytest.approx(p_local * 12 / 16 / GIB)
    n_tok = 16384
    full_set = 2 * (4 * h + (nh * d + 2 * g * d) / t + nh * d / t + 3 * f / t) + 4 * nh / t
    # 256 sequences of 512 + 4096 tokens per mini-batch over 16 ranks -> 5 micro-batches, PP 1 -> 1 in flight.
    act = 1 * layers * n_tok * (2 * h) + n_tok * full_set + n_tok * h * 2
    assert m.activations == pytest.approx(act / GIB)
    assert m.logprob == pytest.approx(min(256 * 2**20, n_tok * v / t * (2 + 8)) / GIB)
    assert m.engine == pytest.approx(40.0)
    assert m.peak == pytest.approx(m.weights + m.grads + m.optimizer + max(m.activations + m.logprob, 40) + 3)

    p_total = 7_615_616_512
    kvpt = 2 * layers * g * d * 2  # 57,344 bytes per token (performance-model.md §4)
    pool = 40 * GIB - 2 * p_total - 2 * GIB
    assert plan.kv_seqs == int(pool // (kvpt * 9216))
    p_act = p_total - v * h  # the input embedding is a lookup, not a GEMM
    # causal attention: sum of s^2 over the 4096 sequences; prompts at 512, responses uniform on [0, 8192]
    # (mean = half the tail): E[s^2] = 512^2 + 2 * 512 * 4096 + 8192^2 / 3
    f_fwd = 2 * p_act * 4096 * 4608 + 2 * layers * nh * d * (512**2 + 2 * 512 * 4096 + 8192**2 / 3) * 4096
    cluster = 32 * 989e12 * 0.35 * (h / t / 2048) ** 0.06  # MFU at this per-GPU GEMM width (launch/plan/model.py)
    assert plan.time.old_logprob == pytest.approx(f_fwd / cluster)
    assert plan.time.update == pytest.approx(4 * f_fwd / cluster)  # 3 (fwd+bwd) + 1 recompute
    conc = min(128, int(pool // (kvpt * 2560)))  # 4096 seqs over 32 engines; live context 512 + 4096/2
    waves = math.ceil(128 / conc)
    # Each earlier wave lasts the mean (4096), the last one the tail (max_new_tokens = 8192): one weight
    # read and a 2 ms fixed cost per step; every generated token reads its context: 512 prompt tokens and
    # its own earlier tokens, whose sum over a response follows E[L^2] / 2 (mean = half the tail: uniform
    # lengths, E[L^2] = 8192^2 / 3).
    steps = waves * 4096 + (8192 - 4096)
    reads = steps * 2 * p_total + 128 * (512 * 4096 + 8192**2 / 3 / 2) * kvpt
    decode = max(steps * 2e-3 + reads / (3.35e12 * 0.45), 128 * 4096 * 2 * p_act / (989e12 * 0.35))
    prefill = 128 * 512 * 2 * p_act / (989e12 * 0.35)
    assert plan.time.generation == pytest.approx(prefill + decode)
    assert plan.time.sync == pytest.approx(3.0 + 2 * p_total / 10e9)


def test_moe_memory_matches_hand_computation():
    """qwen3_30b_a3b_maspo on 4 x 8: PP 2, EP 8, DP 16; expert optimizer state shards over DP/EP = 2."""
    cfg = load_recipe("qwen3_30b_a3b_maspo")
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
    assert plan.fits
    h, nh, g, d, e, fm, k, v = 2048, 32, 4, 128, 128, 768, 8, 151936
    dense_layer = h * nh * d * 2 + 2 * h * g * d + 2 * d + h * e + 2 * h  # attention, QK-norm, router, norms
    expert_layer = e * 3 * h * fm / 8
    p_dense = 24 * dense_layer + v * h + h  # worst stage: embedding (stage 0) == output + norm (stage 1)
    p_expert = 24 * expert_layer
    m = plan.memory
    assert m.weights == pytest.approx((p_dense + p_expert) * 2 / GIB)
    assert m.optimizer == pytest.approx((p_dense / 16 + p_expert / 2) * 12 / GIB)
    full_set = 2 * (4 * h + (nh * d + 2 * g * d) + nh * d + k * (h + 3 * fm)) + 4 * nh + 4 * e
    n_tok = 16384
    act = 2 * 24 * n_tok * (2 * h) + n_tok * full_set + n_tok * h * 2  # 2 micro-batches in flight (PP 2)
    assert m.activations == pytest.approx(act / GIB)


def test_over_large_layout_is_refused_and_a_fitting_one_suggested():
    cfg = load_recipe("r1_distill_qwen_14b_maspo")
    spec = arch_of(cfg)
    lay = dataclasses.replace(layout_of(cfg), tp=1, recompute=None, distributed_optimizer=False)
    plan = estimate(cfg, spec, lay, nodes=1, gpus_per_node=8)
    assert not plan.fits and any("GiB per GPU > 80 GiB" in r for r in plan.reasons)
    better = suggest(cfg, spec, nodes=1, gpus_per_node=8)
    assert better is not None and better.fits and better.memory.peak <= 80
    assert apply_layout(cfg, better.layout)  # expressed as --set overrides


@pytest.mark.parametrize("lay,needle", [
    (Layout(tp=3, pp=1), "not divisible by tensor_model_parallel_size"),
    (Layout(tp=2, pp=1, ep=2), "given for a dense model"),
    (Layout(tp=16, pp=1), "spans nodes"),
    (Layout(tp=2, pp=5), "num_layers=28 is not divisible"),
    (Layout(tp=2, pp=1, vllm_tp=12), "rollout.vllm_tp=12 must divide"),
])
def test_invalid_layouts_are_refused_with_the_reason(lay, needle):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    plan = estimate(cfg, arch_of(cfg), lay, nodes=4, gpus_per_node=8)
    assert any(needle in r for r in plan.reasons), plan.reasons


def test_sequence_longer_than_the_model_context_is_refused():
    cfg = load_recipe("llama3_70b_maspo")
    cfg.rollout.max_new_tokens = 8192
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=8, gpus_per_node=8)
    assert any("max_position_embeddings=8192" in r for r in plan.reasons)


def test_h200_memory_is_an_assumption_not_a_constant():
    cfg = load_recipe("r1_distill_qwen_14b_maspo")
    lay = dataclasses.replace(layout_of(cfg), tp=1, recompute=None, distributed_optimizer=False)
    small = estimate(cfg, arch_of(cfg), lay, nodes=1, gpus_per_node=8)
    big = estimate(cfg, arch_of(cfg), lay, nodes=1, gpus_per_node=8, hw=Assumptions(gpu_mem_gb=141))
    assert not small.fits
    assert big.memory.train_peak == pytest.approx(small.memory.train_peak)


def test_cli_exit_codes_and_suggestion(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "r1_distill_qwen_14b_maspo", "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "nearest fitting layout" in out and "--set parallel.pp=2" in out
    assert main(["plan", "llama3_70b_maspo", "--nodes", "2"]) == 1  # 16 GPUs cannot hold TP 8 x PP 4
    assert "not divisible by tp*pp = 32" in capsys.readouterr().out
