"""The transfer plan (``rollout/transfer_plan.py``): coverage for every registered family and several
layouts, senders by stage and EP rank, the funnel, and a planted gap / duplicate / wrong size failing."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.model.families.registry import families
from megatron_maspo.model.presets import get_preset
from megatron_maspo.rollout.transfer_plan import (
    PlanCoverageError,
    TrainerLayout,
    build_plan,
    check_coverage,
)


def _tiny_spec(family, **over):
    import transformers

    from megatron_maspo.model.hf_config import arch_spec_from_hf

    cfg = transformers.AutoConfig.for_model(family.model_types[0], **{**dict(family.tiny), **over})
    return arch_spec_from_hf(cfg)


FAMILIES = [f for f in families() if f.tiny]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("layout", [TrainerLayout(), TrainerLayout(tp=2, pp=2), TrainerLayout(pp=4, dp=2),
                                    TrainerLayout(pp=2, vpp=2, dp=2, ep=2)], ids=str)
@pytest.mark.parametrize("senders", ["stages", "rank0"])
def test_every_registered_family_is_covered_once_at_full_size(family, layout, senders):
    spec = _tiny_spec(family, num_hidden_layers=4)
    plan = build_plan(spec, layout, engines=(layout.world, layout.world + 1), senders=senders)
    check_coverage(plan, spec)
    assert plan.bytes_total == sum(plan.bytes_by_sender().values())
    if senders == "rank0":
        assert plan.senders == (0,)
    else:
        assert len({s.stage for s in plan.sends}) == layout.pp
        assert set(plan.senders) <= set(range(layout.world))


def test_stage_and_expert_senders_follow_megatrons_rank_order():
    moe = next(f for f in FAMILIES if f.name == "qwen3_moe")
    spec = _tiny_spec(moe, num_hidden_layers=4)
    lay = TrainerLayout(tp=1, pp=2, dp=2, ep=2)  # 4 ranks: stage 0 = ranks 0,1; stage 1 = ranks 2,3
    plan = build_plan(spec, lay, engines=(4, 5))
    by_name = {s.name: s for s in plan.sends}
    assert by_name["model.embed_tokens.weight"].sender == 0
    assert by_name["model.layers.0.self_attn.q_proj.weight"].sender == 0
    assert by_name["model.layers.3.self_attn.q_proj.weight"].sender == 2
    n = spec.num_moe_experts
    assert by_name["model.layers.0.mlp.experts.0.down_proj.weight"].sender == 0
    assert by_name[f"model.layers.0.mlp.experts.{n - 1}.down_proj.weight"].sender == 1
    assert by_name[f"model.layers.2.mlp.experts.{n - 1}.up_proj.weight"].sender == 3
    assert plan.senders == (0, 1, 2, 3)
    assert plan.sender_bytes_max < plan.bytes_total / 2


def test_tp_gathers_in_the_group_and_pp_splits_the_bytes():
    qwen2 = next(f for f in FAMILIES if f.name == "qwen2")
    spec = _tiny_spec(qwen2, num_hidden_layers=4)
    plan = build_plan(spec, TrainerLayout(tp=2, pp=2), engines=(4, 5), dtype="float32")
    assert plan.senders == (0, 2)  # tp rank 0 of each stage
    assert plan.links().keys() == {(0, 4), (0, 5), (2, 4), (2, 5)}
    funnel = build_plan(spec, TrainerLayout(tp=2, pp=2), engines=(4, 5), dtype="float32", senders="rank0")
    assert funnel.sender_bytes_max == funnel.bytes_total == plan.bytes_total


def test_vpp_interleaves_layers_over_stages():
    lay = TrainerLayout(pp=2, vpp=2)
    assert [lay.layer_stage(i, 8) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("break_it", ["drop", "twice", "short", "gap"])
def test_a_planted_fault_fails_the_check(break_it):
    spec = _tiny_spec(FAMILIES[0], num_hidden_layers=2)
    plan = build_plan(spec, TrainerLayout(pp=2), engines=(2,))
    sends = list(plan.sends)
    victim = 3
    if break_it == "drop":
        del sends[victim]
    elif break_it == "twice":
        sends.append(sends[victim])
    elif break_it == "short":
        sends[victim] = dataclasses.replace(sends[victim], nbytes=sends[victim].nbytes - 2)
    else:
        sends[victim] = dataclasses.replace(sends[victim], start=sends[victim].start + 64)
    bad = dataclasses.replace(plan, sends=tuple(sends))
    with pytest.raises(PlanCoverageError, match="does not cover"):
        check_coverage(bad, spec)


@pytest.mark.parametrize("preset,layout", [("qwen2.5-7b", TrainerLayout(tp=4, dp=2)),
                                           ("llama3-70b", TrainerLayout(tp=8, pp=4)),
                                           ("qwen3-30b-a3b", TrainerLayout(pp=2, dp=8, ep=8))])
def test_full_size_layouts_split_the_bytes(preset, layout):
    spec = get_preset(preset)
    plan = build_plan(spec, layout, engines=tuple(range(layout.world, layout.world + 4)))
    check_coverage(plan, spec)
    assert plan.sender_bytes_max / plan.bytes_total <= (1.0 if layout.pp == 1 and layout.ep == 1 else 0.65)
    assert "largest link" in plan.summary()


# ------------------------------------------------------------- expert senders with expert TP = 1 (review #2)
def _megatron_ep_groups(lay: TrainerLayout) -> list[list[int]]:
    """Megatron's EP groups for ``lay`` as ``parallel/groups.py`` builds them (expert TP 1): its expert
    RankGenerator, pure Python."""
    from megatron.core.parallel_state import RankGenerator

    edp = lay.world // (lay.ep * lay.pp)
    return RankGenerator(tp=1, ep=lay.ep, dp=edp, pp=lay.pp, cp=1, order="tp-cp-ep-dp-pp").get_ranks("ep")


@pytest.mark.parametrize("lay", [TrainerLayout(tp=2, pp=2, dp=2, ep=4), TrainerLayout(tp=2, dp=2, ep=2),
                                 TrainerLayout(tp=4, pp=2, dp=24, ep=32), TrainerLayout(tp=2, cp=2, dp=2, ep=4),
                                 TrainerLayout(tp=1, pp=2, dp=4, ep=2), TrainerLayout(tp=8, ep=4)], ids=str)
def test_expert_ranks_match_megatrons_expert_rank_generator(lay):
    groups = _megatron_ep_groups(lay)
    if lay == TrainerLayout(tp=2, pp=2, dp=2, ep=4):
        assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the review's CPU run
    per_stage = lay.stage_size // lay.ep  # expert-DP replicas of a stage
    for s in range(lay.pp):
        dense_tp = set(range(lay.dense_sender(s), lay.dense_sender(s) + lay.tp))
        for j in range(lay.ep):
            src = lay.expert_sender(s, j)
            assert src in {g[j] for g in groups if (g[0] - lay.first_rank) // lay.stage_size == s}
            # outside the dense sender's TP group whenever the stage has a replica there
            if any(k * lay.ep + j >= lay.tp for k in range(per_stage)):
                assert src not in dense_tp, (s, j, src)
    for g in groups:
        stage, k = divmod(g[0] - lay.first_rank, lay.stage_size)
        assert [lay.expert_rank(stage, j, k // lay.ep) for j in range(lay.ep)] == g


def _moe_spec(experts: int):
    from megatron_maspo.model.spec import ArchSpec

    return ArchSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, kv_channels=8, vocab_size=97, max_position_embeddings=64, qk_layernorm=True,
                    num_moe_experts=experts, moe_ffn_hidden_size=16, moe_router_topk=2)


def test_qwen3_235b_disaggregated_senders_are_trainer_ranks_with_distinct_link_members():
    from megatron_maspo.rollout.pools import PoolLayout
    from megatron_maspo.rollout.transfer_plan import plan_pool_transfer

    pools = PoolLayout(world=256, engine_ranks=64, rollout_tp=8, tp=4, pp=2, ep=32, moe=True)
    plan = plan_pool_transfer(_moe_spec(64), pools, "bfloat16")
    assert max(plan.senders) < pools.trainer_world
    # per stage: the dense sender (stage rank 0) and one rank per EP rank, none in the dense sender's TP
    # group (ranks 0-3 of the stage): EP ranks 0-3 are sent by expert-DP replica 1 (stage ranks 32-35)
    assert len(plan.senders) == 2 * (1 + 32)
    assert [r for r in plan.senders if r < 96] == [0, *range(4, 36)]
    for link in pools.weight_links:
        assert len(set(link.ranks)) == len(link.ranks), link


def test_plan_pool_transfer_refuses_a_sender_in_the_rollout_pool(monkeypatch):
    from megatron_maspo.rollout.pools import PoolLayout
    from megatron_maspo.rollout.transfer_plan import plan_pool_transfer

    # the formula before the fix (expert TP = TP): senders up to rank 220 of a 192-rank training pool
    monkeypatch.setattr(TrainerLayout, "expert_sender", lambda self, s, j: self.dense_sender(s) + self.tp * j)
    pools = PoolLayout(world=256, engine_ranks=64, rollout_tp=8, tp=4, pp=2, ep=32, moe=True)
    with pytest.raises(ValueError, match="outside the training pool"):
        plan_pool_transfer(_moe_spec(64), pools, "bfloat16")
