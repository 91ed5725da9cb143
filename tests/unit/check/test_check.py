"""``maspo check`` on the shipped recipes (meta device, fake process groups), and that it fails, naming the
cause, when today's defects are put back: the 512 MiB bucket limit (7B recipe), engines without a GPU of
their own (8 engines on one node), a conversion-table entry missing."""

from __future__ import annotations

import math

import pytest

from megatron_maspo.check.run import check_config, documented_layout
from megatron_maspo.check.world import coordinates
from megatron_maspo.recipes.registry import list_recipes, resolve_config

ALL = list_recipes()  # the shipped recipes (helper modules such as registry.py are not recipes)
FAST = ["tiny", "smollm2", "r1_distill_qwen_1p5b_maspo", "r1_distill_qwen_7b_maspo"]
SLOW = [r for r in ALL if r not in FAST]


def _check(recipe: str, **layout):
    cfg = resolve_config(recipe, None, [])
    nodes, gpus = documented_layout(cfg)
    return check_config(cfg, nodes=layout.get("nodes", nodes), gpus_per_node=layout.get("gpus_per_node", gpus))


def test_distinct_coordinates_follow_megatrons_rank_order():
    cs = coordinates(64, tp=8, pp=4, ep=1)
    assert len(cs) == 32 and [c.rank for c in cs[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 16]
    moe = coordinates(32, tp=1, pp=2, ep=8)
    assert len(moe) == 16 and {c.ep for c in moe} == set(range(8)) and {c.pp for c in moe} == {0, 1}
    with pytest.raises(ValueError, match="not divisible"):
        coordinates(12, tp=8, pp=1, ep=1)


@pytest.mark.parametrize("recipe", FAST)
def test_fast_recipes_pass(recipe):
    res = _check(recipe)
    assert res.ok, res.lines
    assert [ln.split(":")[0] for ln in res.lines[1:]] == ["ok   tables", "ok   checkpoint", "ok   weight sync",
                                                          "ok   engine placement", "ok   process groups",
                                                          "ok   host shared memory", "ok   memory plan"]
    if "7b" in recipe:  # defect 2: the 1,040 MiB embedding crosses the default 512 MiB bucket in pieces
        sync = next(ln for ln in res.lines if "weight sync" in ln)
        assert "model.embed_tokens.weight (152064, 3584) = 1,040 MiB, split over 3 buckets" in sync


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SLOW)
def test_every_other_shipped_recipe_passes(recipe):
    res = _check(recipe)
    assert res.ok, res.lines


def test_todays_512_mib_bucket_limit_fails_the_7b_recipe(monkeypatch):
    from megatron_maspo.rollout import buckets

    real = buckets.plan_buckets

    def reject_large(entries, bucket_bytes):  # the rule pack_buckets had before tensors could be split
        entries = list(entries)
        for name, dt, shape in entries:
            nbytes = math.prod(shape) * buckets.dtype_size(dt)
            if nbytes > bucket_bytes:
                raise ValueError(f"tensor {name!r} {shape} needs {nbytes} bytes > bucket size {bucket_bytes}")
        return real(entries, bucket_bytes)

    monkeypatch.setattr(buckets, "plan_buckets", reject_large)
    res = _check("r1_distill_qwen_7b_maspo")
    assert not res.ok and res.error.step == "weight sync"
    assert "model.embed_tokens.weight" in str(res.error) and "bucket size 536870912" in str(res.error)


def test_engines_without_their_own_gpu_fail_8_engines_on_one_node(monkeypatch):
    from megatron_maspo.rollout import fleet

    # Before per-engine placement every engine's workers went to the first GPUs (vLLM's cuda:{local_rank})
    monkeypatch.setattr(fleet, "place_engine", lambda engine, owner, tp, gpn: fleet.EnginePlacement(
        engine=engine, owner=owner, node=owner // gpn, gpus=tuple(range(tp))))
    res = _check("r1_distill_qwen_1p5b_maspo", nodes=1, gpus_per_node=8)
    assert not res.ok and res.error.step == "engine placement"
    assert "engines 0 and 1 both placed on node 0 GPU 0" in str(res.error)


def test_a_missing_table_entry_is_named(monkeypatch):
    import dataclasses

    from megatron_maspo.model.families import registry

    qwen2 = registry.get_family("qwen2")  # FAMILY_TABLES is a read-only view: patch the declaration
    layer = tuple(e for e in qwen2.names.layer if "o_proj" not in e.hf_names[0])
    monkeypatch.setitem(registry._FAMILIES, "qwen2",
                        dataclasses.replace(qwen2, names=dataclasses.replace(qwen2.names, layer=layer)))
    res = _check("r1_distill_qwen_1p5b_maspo")
    assert not res.ok and res.error.step == "tables"
    assert "self_attention.linear_proj.weight is in no conversion-table entry" in str(res.error)


def test_cli_prints_the_report_and_exits_by_outcome(capsys):
    from megatron_maspo.cli.main import main

    assert main(["check", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "ok   memory plan" in out and "1 x 1 GPUs" in out
    assert main(["check", "tiny", "--nodes", "0"]) == 2
    assert main(["check", "r1_distill_qwen_7b_maspo", "--nodes", "1", "--gpus-per-node", "3"]) == 1
    assert "FAIL [layout]" in capsys.readouterr().out


def test_te_backend_is_checked_under_the_recorded_te_names():
    cfg = resolve_config("r1_distill_qwen_1p5b_maspo", None, ["model.attention_backend=te"])
    res = check_config(cfg, nodes=1, gpus_per_node=8)
    assert res.ok, res.lines
    assert "TE (recorded names) spec" in res.lines[0] and "TE-spec names resolve" in res.lines[1]


DISAGG = ["rollout.placement=disaggregated", "rollout.max_staleness=1", "loss.tis_cap=2.0"]


def test_disaggregated_7b_checks_the_training_pool_and_the_engines_own_gpus():
    """16 training + 16 engine GPUs: the 16 trainer ranks are built, the engines sit on nodes 2-3 by
    ``PoolLayout.placement``, and the peaks are the trainer's own and the engine's own."""
    cfg = resolve_config("r1_distill_qwen_7b_maspo", None,
                         [*DISAGG, "rollout.engine_ranks=16", "rollout.vllm_gpu_memory_utilization=0.9"])
    res = check_config(cfg, nodes=4, gpus_per_node=8)
    assert res.ok, res.lines
    assert "in the training pool of 16 GPUs (16 engine GPUs)" in res.lines[0]
    place = next(ln for ln in res.lines if "engine placement" in ln)
    assert "16 vllm engines" in place and "node 2: [0] [1]" in place and "ranks 16-31" in place
    plan = next(ln for ln in res.lines if "transfer plan" in ln)
    assert "(stages, bfloat16): 1 sender(s) -> 16 engine(s)" in plan and "largest link: rank 0" in plan
    mem = next(ln for ln in res.lines if "memory plan" in ln)
    assert "per training GPU 34.5 (the trainer's own: no engine on it), per engine GPU 76.5" in mem


def test_transfer_plan_step_fails_on_an_uncovered_tensor():
    import dataclasses

    from megatron_maspo.check.pools import check_transfer_plan
    from megatron_maspo.check.steps import CheckError
    from megatron_maspo.model.presets import get_preset
    from megatron_maspo.rollout.transfer_plan import TrainerLayout, build_plan

    spec = get_preset("llama3-70b")
    plan = build_plan(spec, TrainerLayout(tp=8, pp=4), engines=tuple(range(32, 64, 8)))
    assert "4 sender(s) -> 4 engine(s)" in check_transfer_plan(plan, spec)
    planted = dataclasses.replace(plan, sends=plan.sends[:7] + plan.sends[8:])  # one layer tensor left out
    with pytest.raises(CheckError, match=r"\[transfer plan\] .*1 engine tensor\(s\) uncovered"):
        check_transfer_plan(planted, spec)


def _tiny_disagg(*sets: str):
    return resolve_config("tiny", None, [*DISAGG, *sets])


def test_disaggregated_refusals_name_their_step():
    # the training pool's 17 ranks are not a multiple of the trainer's tp = 2
    cfg = resolve_config("r1_distill_qwen_7b_maspo", None, [*DISAGG, "rollout.engine_ranks=15"])
    res = check_config(cfg, nodes=4, gpus_per_node=8)
    assert res.error.step == "layout" and "17 training + 15 engine GPUs" in str(res.error)
    # two TP-4 engines on 8 ranks after a 4-rank training pool, 6-GPU nodes: engine 0 spans two nodes
    res = check_config(_tiny_disagg("parallel.world_size=12", "rollout.engine=vllm", "rollout.vllm_tp=4",
                                    "rollout.engine_ranks=8"), nodes=2, gpus_per_node=6)
    assert res.error.step == "engine placement" and "spans two nodes of 6 GPUs" in str(res.error)
    # an engine share its own GPU cannot hold
    res = check_config(_tiny_disagg("parallel.world_size=2", "rollout.engine=vllm", "rollout.engine_ranks=1",
                                    "rollout.vllm_gpu_memory_utilization=0.99"), nodes=1, gpus_per_node=2)
    assert res.error.step == "memory plan" and "per engine GPU > 80 GiB" in str(res.error)


def test_pool_placement_refuses_an_engine_on_a_training_gpu():
    from megatron_maspo.check.steps import CheckError, check_pool_placement
    from megatron_maspo.rollout.fleet import EnginePlacement
    from megatron_maspo.rollout.pools import PoolLayout

    class Overlapping(PoolLayout):  # a layout bug that put engine 0 on the last training GPU
        def placement(self, gpus_per_node):
            return (EnginePlacement(engine=0, owner=3, node=0, gpus=(3,)),)

    with pytest.raises(CheckError, match="shares a GPU of the training pool"):
        check_pool_placement(Overlapping(world=8, engine_ranks=4), 1, 8)
    assert len(check_pool_placement(PoolLayout(world=8, engine_ranks=4), 1, 8)) == 4
