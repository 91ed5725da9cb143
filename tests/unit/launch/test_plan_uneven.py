"""Issue 56: the planner and the transfer plan take uneven pipeline stages (``parallel.pp_first_layers`` /
``pp_last_layers``): 61 DeepSeek-V3 layers at PP 16 and 94 Qwen3-235B layers at PP 8 are no longer refused
for divisibility, stage sizes follow Megatron's split, and the layout search proposes uneven splits."""

from __future__ import annotations

import pytest

from megatron_maspo.launch.plan import arch_of, estimate, layout_of
from megatron_maspo.launch.plan.model import stage_layers
from megatron_maspo.launch.plan.moe_comm import moe_layers_on_busiest_stage
from megatron_maspo.launch.plan.types import Layout, gpu_assumptions
from megatron_maspo.overrides import set_path
from megatron_maspo.recipes.registry import load_recipe
from megatron_maspo.rollout.transfer_plan import TrainerLayout


def _plan(recipe: str, nodes: int, sets: dict):
    cfg = load_recipe(recipe)
    for key, value in sets.items():
        cfg = set_path(cfg, key, value)
    return estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8,
                    hw=gpu_assumptions(cfg.parallel.gpu))


DSV3 = {"parallel.gpu": "h100", "parallel.tp": 1, "parallel.pp": 16, "parallel.ep": 16}
Q235 = {"parallel.tp": 2, "parallel.pp": 8, "parallel.ep": 16, "parallel.cp": 2, "model.attention_backend": "te"}


@pytest.mark.parametrize("recipe,nodes,sets,split", [
    ("deepseek_v3_maspo", 32, DSV3, {"parallel.pp_first_layers": 1}),
    ("qwen3_235b_a22b_maspo", 16, Q235, {"parallel.pp_first_layers": 11, "parallel.pp_last_layers": 11}),
])
def test_published_uneven_layouts_are_refused_for_divisibility_only_without_a_split(recipe, nodes, sets, split):
    even = _plan(recipe, nodes, sets)
    assert any("not divisible by pipeline stages" in r and "pp_first_layers" in r for r in even.reasons)
    uneven = _plan(recipe, nodes, {**sets, **split})
    assert not any("divisible" in r or "split evenly" in r for r in uneven.reasons), uneven.reasons
    assert uneven.memory is not None


def test_stage_sizes_follow_megatrons_split():
    assert [len(s) for s in stage_layers(61, 16, None, 1, None)] == [1] + [4] * 15
    assert [len(s) for s in stage_layers(94, 8, None, 11, 11)] == [11] + [12] * 6 + [11]
    assert Layout(tp=1, pp=16, pp_first=1).stage_layer_count(61) == 4
    assert Layout(tp=1, pp=16).stage_layer_count(61) == 4  # refused elsewhere; estimated as ceil(L / pp)


def test_dense_first_layers_and_an_uneven_split_count_moe_layers_per_stage():
    spec = arch_of(load_recipe("deepseek_v3_maspo"))  # 3 dense first layers, then 58 MoE layers
    assert spec.moe_first_k_dense == 3
    # 1 + 15x4: stage 1 holds layers 1-4 (two dense), every later stage four MoE layers
    assert moe_layers_on_busiest_stage(spec, 16, None, 1, None) == 4
    assert moe_layers_on_busiest_stage(spec, 16, None, 16, None) == 16 - 3  # 16 + 15x3


def test_the_transfer_plan_puts_each_layer_on_the_stage_that_builds_it():
    lay = TrainerLayout(pp=3, pp_first=1)
    assert [lay.layer_stage(i, 5) for i in range(5)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="transfer plan: .*pp_first_layers"):
        TrainerLayout(pp=2).layer_stage(0, 5)
