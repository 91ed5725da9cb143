"""Generation-time model: the straggler tail, KV reads per token, waves, MoE weight reads, CLI inputs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.rollout import (
    EngineLoad,
    exponential_expected_max,
    generation_seconds,
    length_second_moment,
    moe_touched_fraction,
)
from megatron_maspo.recipes.registry import load_recipe

HW = dict(hbm_tb_s=2.0, decode_eff=0.5, peak_tflops=1000.0, mfu=0.5)
LOAD = EngineLoad(seqs=10, conc=4, prompt=100, mean=200, tail=1000, weight_bytes_full=1e9,
                  weight_bytes_tail=1e9, kv_token_bytes=1000.0, active_params=1e6, vllm_tp=1)


def test_hand_computed_generation_with_tail_and_waves():
    # 3 waves: 2 end with the mean (200 steps each), the last lasts the tail (1000) -> 1400 weight reads;
    # 10 responses of mean 200 read their 100 prompt tokens per token and their own earlier tokens,
    # E[L^2] / 2 per response (lengths spread on [0, 1000] with mean 200), 1000 bytes each.
    reads = 1400 * 1e9 + 10 * (100 * 200 + length_second_moment(200, 1000) / 2) * 1000
    prefill = 10 * 100 * 2e6 / 5e14
    assert generation_seconds(LOAD, **HW) == pytest.approx(prefill + reads / 1e12)
    # the fixed per-step cost counts once per decode step of the engine
    assert generation_seconds(LOAD, **HW, step_fixed_s=1e-3) == pytest.approx(prefill + reads / 1e12 + 1.4)


def test_tail_dominates_when_weights_dominate():
    short = dataclasses.replace(LOAD, tail=200)
    kv = 10 * (100 * 200 + length_second_moment(200, 1000) / 2) * 1000
    assert generation_seconds(LOAD, **HW) / generation_seconds(short, **HW) == pytest.approx(
        (1400e9 + kv) / (600e9 + 4e8), rel=1e-4)


@pytest.mark.parametrize("mean,tail,ratio", [(100, 1e5, 2.0), (500, 1000, 4 / 3), (1000, 1000, 1.0)])
def test_length_second_moment_follows_the_spread(mean, tail, ratio):
    """E[L^2] / mean^2 of the maximum-entropy lengths on [0, tail]: 2 for an exponential (mean << tail),
    4/3 for uniform lengths (mean = tail / 2), 1 when every response reaches the tail."""
    assert length_second_moment(mean, tail) / mean**2 == pytest.approx(ratio, rel=1e-3)


def test_length_second_moment_matches_a_sampled_truncated_exponential():
    import math
    import random

    rng, rate, tail = random.Random(0), 3.0 / 1000, 1000.0
    xs = []
    while len(xs) < 200_000:
        x = rng.expovariate(rate)
        if x <= tail:
            xs.append(x)
    mean = sum(xs) / len(xs)
    assert length_second_moment(mean, tail) == pytest.approx(sum(x * x for x in xs) / len(xs), rel=0.01)
    assert math.isfinite(length_second_moment(0.999 * tail, tail))


def test_moe_touched_fraction():
    assert moe_touched_fraction(1, 128, 8) == pytest.approx(8 / 128)
    assert moe_touched_fraction(256, 128, 8) > 0.99


def test_response_lengths_are_inputs_and_a_shorter_tail_is_faster():
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    spec, lay = arch_of(cfg), layout_of(cfg)
    plan = lambda **kw: estimate(cfg, spec, lay, nodes=4, gpus_per_node=8, hw=Assumptions(**kw))  # noqa: E731
    default = plan()
    assert plan(response_mean=4096, response_max=8192).time == default.time  # the defaults spelled out
    short = plan(response_mean=4096, response_max=5000)
    assert short.time.generation < default.time.generation
    # a shorter tail narrows the spread of the lengths: the trainer's attention (sum of s^2) shrinks a little
    assert short.time.update < default.time.update < 1.1 * short.time.update
    longer = plan(response_mean=6000)
    assert longer.time.update > default.time.update and longer.time.generation > default.time.generation
    bad = plan(response_mean=9000, response_max=8192)
    assert any("mean response 9000" in r for r in bad.reasons)


def test_moe_expert_flops_run_at_their_own_utilisation():
    cfg = load_recipe("qwen3_30b_a3b_maspo")
    spec, lay = arch_of(cfg), layout_of(cfg)
    slow = estimate(cfg, spec, lay, nodes=4, gpus_per_node=8, hw=Assumptions(moe_expert_mfu=0.03))
    fast = estimate(cfg, spec, lay, nodes=4, gpus_per_node=8, hw=Assumptions(moe_expert_mfu=0.35))
    assert slow.time.update > 3 * fast.time.update
    dense = load_recipe("r1_distill_qwen_7b_maspo")
    a = estimate(dense, arch_of(dense), layout_of(dense), nodes=4, gpus_per_node=8,
                 hw=Assumptions(moe_expert_mfu=0.03))
    b = estimate(dense, arch_of(dense), layout_of(dense), nodes=4, gpus_per_node=8,
                 hw=Assumptions(moe_expert_mfu=0.35))
    assert a.time == b.time  # dense models have no expert FLOPs


def test_cli_response_flags(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", "--response-mean", "2500",
                 "--response-max", "6000"]) == 0
    out = capsys.readouterr().out
    assert "'response_mean': 2500.0" in out and "'response_max': 6000.0" in out
    assert "32 engine(s) of rollout TP 1" in out and "longest response 6000 tokens" in out
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", "--response-mean", "-1"]) == 2


def test_exponential_expected_max_is_mean_times_harmonic_number():
    assert exponential_expected_max(100.0, 1) == pytest.approx(100.0)
    assert exponential_expected_max(100.0, 4) == pytest.approx(100.0 * (1 + 1 / 2 + 1 / 3 + 1 / 4))


def test_trainer_attention_follows_the_spread_of_the_lengths():
    """The trainer's causal attention costs sum s^2 over the step's sequences: n E[s^2] with the responses
    spread between 0 and the tail (plan.seq_second_moment), the mean's square only when every response
    reaches the tail."""
    from megatron_maspo.launch.plan.estimator import seq_second_moment

    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    spec, lay = arch_of(cfg), layout_of(cfg)
    plan = estimate(cfg, spec, lay, nodes=4, gpus_per_node=8, hw=Assumptions(prompt_mean=100, response_mean=2000,
                                                                           response_max=8000))
    assert plan.time is not None
    sh = dataclasses.make_dataclass("S", ["avg_prompt", "avg_resp", "tail"])(100, 2000, 8000)
    assert seq_second_moment(sh) == pytest.approx(100**2 + 2 * 100 * 2000 + length_second_moment(2000, 8000))
    assert seq_second_moment(sh) > 2100**2
    flat = dataclasses.make_dataclass("S", ["avg_prompt", "avg_resp", "tail"])(100, 8000, 8000)
    assert seq_second_moment(flat) == pytest.approx(8100**2)
