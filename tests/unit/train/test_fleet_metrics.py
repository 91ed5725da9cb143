"""Per-engine figures -> rollout/* fleet metrics (rounds of one step summed per engine)."""

from __future__ import annotations

import pytest

from megatron_maspo.train.rollouts.shard import EngineRound, fleet_metrics, reward_totals


def test_rounds_sum_per_engine_and_idle_engines_count_for_prompts_only():
    rounds = [EngineRound(engine=0, prompts=2, tokens=100, seconds=1.0, version=3, reward_totals={"correct": 4}),
              EngineRound(engine=1, prompts=1, tokens=30, seconds=1.0, version=3, reward_totals={"correct": 1}),
              EngineRound(engine=0, prompts=1, tokens=50, seconds=0.5, version=3),  # a 2nd sampling round
              EngineRound(engine=2, prompts=0, version=2)]  # no prompts left for this engine
    m = fleet_metrics(rounds, num_engines=3)
    assert m["rollout/engines"] == 3
    assert m["rollout/prompts_per_engine_max"] == 3 and m["rollout/prompts_per_engine_min"] == 0
    assert m["rollout/gen_tokens_per_s_engine_mean"] == pytest.approx((100.0 + 30.0) / 2)
    assert m["rollout/gen_tokens_per_s_engine_min"] == pytest.approx(30.0)
    assert (m["rollout/engine_policy_version_min"], m["rollout/engine_policy_version_max"]) == (2, 3)
    assert reward_totals(rounds) == {"correct": 5}
