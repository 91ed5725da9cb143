"""Cluster recipes: each loads, carries the paper's settings, and fits at its intended cluster size."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.config import list_recipes, load_recipe
from megatron_maspo.launch.plan import arch_of, estimate, layout_of

# Single-machine recipes (tiny: CPU default; smollm2: one GPU) are not cluster layouts.
CLUSTER = [r for r in list_recipes() if r not in ("tiny", "smollm2")]
PAPER = [r for r in CLUSTER if r.startswith("r1_distill_qwen")]


def test_expected_recipes_exist():
    for name in ("r1_distill_qwen_1p5b_maspo", "r1_distill_qwen_7b_maspo", "r1_distill_qwen_14b_maspo",
                 "r1_distill_qwen_1p5b_grpo", "r1_distill_qwen_7b_grpo", "r1_distill_qwen_14b_grpo",
                 "qwen25_7b_maspo", "llama3_70b_maspo", "qwen3_30b_a3b_maspo"):
        assert name in CLUSTER


@pytest.mark.parametrize("name", CLUSTER)
def test_recipe_fits_its_intended_cluster(name):
    cfg = load_recipe(name)
    assert cfg.model.arch and cfg.model.source.startswith("/models/")
    nodes, rem = divmod(cfg.parallel.world_size, 8)
    assert rem == 0 and nodes >= 1
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8)
    assert plan.fits, plan.reasons
    assert plan.memory.peak <= 80 and plan.kv_seqs >= 1


@pytest.mark.parametrize("name", PAPER)
def test_paper_settings(name):
    c = load_recipe(name)
    assert (c.train.prompts_per_step, c.train.mini_batches_per_step, c.rollout.group_size) == (512, 16, 8)
    assert c.rollout.max_new_tokens == 8192 and c.rollout.temperature == 1.0 and c.rollout.top_p == 1.0
    assert c.optim.lr == 1e-6 and c.optim.lr_decay_style == "constant" and c.optim.warmup_steps == 0
    assert (c.optim.adam_beta1, c.optim.adam_beta2) == (0.9, 0.95)
    assert c.loss.kl_coef == 0.0 and (c.loss.eps_low, c.loss.eps_high) == (0.2, 0.2)
    assert (c.loss.sigma_base, c.loss.beta_high, c.loss.beta_low) == (1.0, 0.03, 0.03)
    assert c.loss.alpha == (0.5 if "14b" in name else 0.3)
    assert c.loss.method == ("grpo" if name.endswith("_grpo") else "maspo")
    assert c.model.bf16 and c.rollout.engine == "vllm"


@pytest.mark.parametrize("size", ["1p5b", "7b", "14b"])
def test_grpo_counterpart_changes_only_the_loss_method_and_run_dir(size):
    m = load_recipe(f"r1_distill_qwen_{size}_maspo")
    g = load_recipe(f"r1_distill_qwen_{size}_grpo")
    assert dataclasses.replace(g, loss=dataclasses.replace(g.loss, method="maspo"),
                               checkpoint=m.checkpoint) == m
    assert g.checkpoint.run_dir != m.checkpoint.run_dir


def test_moe_recipe_uses_expert_parallelism():
    c = load_recipe("qwen3_30b_a3b_maspo")
    assert c.parallel.ep == 8 and c.parallel.tp == 1 and c.parallel.dp % c.parallel.ep == 0
