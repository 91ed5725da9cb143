"""Cluster recipes: each loads, carries the paper's settings, and fits at its intended cluster size."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_maspo.launch.plan import arch_of, estimate, layout_of
from megatron_maspo.launch.plan.types import gpu_assumptions
from megatron_maspo.recipes.base import ADV_REWEIGHT, SETTINGS, SIZES, TABLE1
from megatron_maspo.recipes.registry import list_recipes, load_recipe

# Single-machine recipes (tiny: CPU default; smollm2: one GPU) are not cluster layouts.
CLUSTER = [r for r in list_recipes() if r not in ("tiny", "smollm2")]
PAPER = [r for r in CLUSTER if r.startswith("r1_distill_qwen")]


def test_expected_recipes_exist():
    for name in ("r1_distill_qwen_1p5b_maspo", "r1_distill_qwen_7b_maspo", "r1_distill_qwen_14b_maspo",
                 "r1_distill_qwen_1p5b_grpo", "r1_distill_qwen_7b_grpo", "r1_distill_qwen_14b_grpo",
                 "qwen25_7b_maspo", "llama3_70b_maspo", "qwen3_30b_a3b_maspo", "glm45_air_maspo",
                 "deepseek_v3_maspo", "qwen3_235b_a22b_maspo"):
        assert name in CLUSTER


@pytest.mark.parametrize("name", CLUSTER)
def test_recipe_fits_its_intended_cluster(name):
    cfg = load_recipe(name)
    assert cfg.model.arch and cfg.model.source.startswith("/models/")
    nodes, rem = divmod(cfg.parallel.world_size, 8)
    assert rem == 0 and nodes >= 1
    hw = gpu_assumptions(cfg.parallel.gpu)  # the GPU the recipe is sized for (H100 unless it says)
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8, hw=hw)
    assert plan.fits, plan.reasons
    assert plan.memory.peak <= hw.gpu_mem_gb and plan.kv_seqs >= 1


@pytest.mark.parametrize("name", PAPER)
def test_paper_settings(name):
    c = load_recipe(name)
    for key, (value, _) in SETTINGS.items():  # every labelled value is what the recipe runs with
        obj = c
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == value, key
    size = name.split("_")[3]
    assert c.loss.maspo.alpha == SIZES[size][5]
    assert c.model.bf16 and c.rollout.engine == "vllm"


def test_every_paper_label_cites_a_section():
    labels = [src for _, src in SETTINGS.values()] + [s[6] for s in SIZES.values()] + [ADV_REWEIGHT[1]]
    for src in labels:
        if src.startswith("paper"):
            assert re.match(r"paper (§\d|App\. [A-D]|Table \d)", src), src
        else:  # not the paper's: says whose default it is or that it is ours
            assert "default" in src or "our choice" in src, src
    assert SIZES["1p5b"][5] == 0.5 and "D.4" in SIZES["1p5b"][6]


def test_every_cited_paper_location_exists():
    """Issue 34 defect 7: each "paper ..." label (recipes) and each "MASPO <location>" in the loss
    parameter docs names a section / appendix / table present in the MASPO text (`recipes/_paper_locations.py`),
    and none cites the missing Table 4 as a value's source."""
    import inspect

    from megatron_maspo.loss import config as loss_config
    from megatron_maspo.loss import params as loss_params
    from megatron_maspo.recipes._paper_locations import cited_locations, unknown_locations

    labels = [src for _, src in SETTINGS.values()] + [s[6] for s in SIZES.values()] + [ADV_REWEIGHT[1]]
    for src in labels:
        if src.startswith("paper"):
            assert cited_locations(src) and not unknown_locations(src), src
    n_cited = 0
    for mod in (loss_params, loss_config):
        for line in inspect.getsource(mod).splitlines():
            for chunk in re.findall(r"MASPO ((?:§|App\. |Table )[^)\"]*)", line):
                n_cited += 1
                assert not unknown_locations(chunk), (mod.__name__, line.strip())
    assert n_cited >= 8  # the check is not vacuous
    assert unknown_locations("paper Table 4") == ["Table 4"]
    assert unknown_locations("paper §5.3 / Table 5") == []


def test_table1_has_every_method_at_1p5b_and_7b():
    for size in ("1p5b", "7b"):
        for method in TABLE1:
            c = load_recipe(f"r1_distill_qwen_{size}_{method}")
            want = {"entropy_reg": "grpo", "entropy_adv": "grpo", "adv_reweight": "grpo"}.get(method, method)
            assert c.loss.method == want
            assert (c.loss.entropy_coef > 0) == (method == "entropy_reg")
            assert (c.loss.entropy_adv.coef > 0) == (method == "entropy_adv")
            assert c.loss.adv_reweight.alpha == (0.1 if method == "adv_reweight" else 0.0)
    ch = load_recipe("r1_distill_qwen_7b_clip_higher")
    assert ch.loss.params.eps_high == 0.265 and ch.loss.params.dual_clip_c == 3.0
    assert load_recipe("r1_distill_qwen_7b_sapo").loss.effective_aggregation == "seq-mean-token-mean"


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
