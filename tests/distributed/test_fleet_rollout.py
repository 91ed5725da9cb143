"""The rollout fleet on gloo: 2 ranks (DP 2) build 2 built-in engines, each generates half of the step's
groups, and the gathered groups equal a 1-rank run's (same prompts, tokens, log-probs, rewards).

A real ``Trainer`` on the tiny recipe (Megatron actor, initial weight sync into every engine, math grader).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed._launch import run_workers


def _cfg(run_dir: str):
    from megatron_maspo.recipes.tiny import config

    cfg = config()
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, sft_steps=0, prompts_per_step=5,
                                                mini_batches_per_step=1),
        rollout=dataclasses.replace(cfg.rollout, group_size=4, max_new_tokens=6),
        checkpoint=dataclasses.replace(cfg.checkpoint, run_dir=run_dir))


def _worker(rank: int, world: int, run_dir: str):
    from megatron_maspo.train.loop import Trainer
    from megatron_maspo.train.rollouts.shard import fleet_metrics

    tr = Trainer(_cfg(f"{run_dir}/w{world}"))
    side = tr.rollouts
    try:
        tr.sync()  # the initial sync: every engine from its own replica
        batch, rounds = side.maker.make(0, tr.version)  # one round: no dynamic sampling here
        groups = batch.seen
        idx = [g.prompt_index for g in groups]
    finally:
        side.close()
    return {"engine": side.shard.engine_id if side.shard else None, "idx": idx,
            "rounds": [(r.engine, r.prompts, r.version) for r in rounds],
            "metrics": fleet_metrics(rounds, side.fleet.num_engines),
            "groups": [(g.prompt_index, [c.token_ids for c in g.completions_G],
                        [c.logprobs for c in g.completions_G], g.rewards_G) for g in groups]}


def test_two_engines_gather_the_one_engine_result(tmp_path):
    one = run_workers(_worker, 1, str(tmp_path))[0]
    two = run_workers(_worker, 2, str(tmp_path))
    assert [r["engine"] for r in two] == [0, 1]
    assert two[0]["rounds"] == [(0, 3, 1), (1, 2, 1)]  # each engine generated its shard, at policy version 1
    assert two[0]["metrics"]["rollout/engines"] == 2.0
    assert two[0]["metrics"]["rollout/prompts_per_engine_max"] == 3.0
    assert two[0]["groups"] == two[1]["groups"]  # every rank holds all groups
    assert [g[0] for g in two[0]["groups"]] == one["idx"] == two[0]["idx"]
    for (p1, t1, lp1, r1), (p2, t2, lp2, r2) in zip(one["groups"], two[0]["groups"], strict=True):
        assert p1 == p2 and t1 == t2 and r1 == r2
        for a, b in zip(lp1, lp2, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    # The planner reads the same FleetLayout: its engine count and per-engine load are what the runs built.
    from megatron_maspo.launch.plan import arch_of, estimate, layout_of

    cfg = _cfg(str(tmp_path / "plan"))
    for world, run in ((1, one), (2, two[0])):
        plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=1, gpus_per_node=world)
        built = run["rounds"]
        assert plan.engines == len(built) == world
        assert plan.prompts_per_engine == max(p for _, p, _ in built)
        assert plan.transport == "in-process" and plan.bucket_mb == cfg.rollout.bucket_mb
