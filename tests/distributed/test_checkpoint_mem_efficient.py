"""Distributed-optimizer checkpoints use megatron-core's memory-efficient ``fully_reshardable`` save
(issue 29, defect 8b): the fp32 master copies and both Adam moments are gathered over the gloo DP group
onto DP rank 0 only, not all-gathered onto every DP rank's CPU, and a resumed actor continues exactly.

2 gloo ranks, DP 2, distributed optimizer, the trainer's gloo-group setting (``init_parallel(gloo_groups=
True)``). Without the gloo groups (every non-trainer job) the optimizer falls back to the all-gather save.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _actor(world: int, gloo: bool):
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    spec = H.qwen2_spec()
    groups = init_parallel(seed=11, gloo_groups=gloo)
    return build_actor(H.make_cfg(world, dist_opt=True), spec, groups, init_weights=H.name_init(spec, groups))


def _opt_state(actor) -> list[torch.Tensor]:
    out = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for st in opt.optimizer.state.values():
            out += [v.clone() for k, v in sorted(st.items()) if torch.is_tensor(v) and k != "step"]
        for g in opt.optimizer.param_groups:
            out += [p.detach().clone() for p in g["params"]]
    return out


def _worker(rank: int, world: int, ckpt_dir: str) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_maspo.parallel.groups import gloo_groups_available
    from megatron_maspo.train.actor.checkpoint import (
        load_checkpoint,
        optimizer_metadata,
        save_checkpoint,
    )

    calls: list[dict] = []
    orig = DistributedOptimizer.get_parameter_state_dp_zero

    def spy(self, use_gloo_comm=True, empty_data=False, return_on_all_ranks=False):
        out = orig(self, use_gloo_comm=use_gloo_comm, empty_data=empty_data,
                   return_on_all_ranks=return_on_all_ranks)
        if not empty_data:  # the save (a load passes empty_data)
            calls.append({"gloo": use_gloo_comm, "all_ranks": return_on_all_ranks, "built": out is not None})
        return out

    DistributedOptimizer.get_parameter_state_dp_zero = spy
    res: dict = {}
    actor = _actor(world, gloo=True)
    res["gloo"] = gloo_groups_available()
    res["meta"] = optimizer_metadata(actor.optimizer)
    actor.train_step(H.make_samples(seed=1))
    path = save_checkpoint(actor, ckpt_dir, 1)
    res["save_calls"] = calls
    saved = _opt_state(actor)
    resumed = _actor(world, gloo=True)
    load_checkpoint(resumed, path)
    res["opt_equal"] = all(torch.equal(a, b) for a, b in zip(saved, _opt_state(resumed), strict=True))
    m1, m2 = actor.train_step(H.make_samples(seed=2)), resumed.train_step(H.make_samples(seed=2))
    res["metrics_equal"] = m1["actor/loss"] == m2["actor/loss"]
    res["params_equal"] = all(torch.equal(a, b) for a, b in zip(
        (p for c in actor.chunks for p in c.parameters()), (p for c in resumed.chunks for p in c.parameters())))
    plain = _actor(world, gloo=False)  # a job without the gloo groups: the all-gather save, still loadable
    res["plain_meta"] = optimizer_metadata(plain.optimizer)
    return res


def test_distributed_optimizer_saves_on_dp_rank_0_only_and_resumes_exactly(tmp_path):
    r0, r1 = run_workers(_worker, 2, str(tmp_path / "ckpt"), timeout_s=600)
    for r in (r0, r1):
        assert r["gloo"] and r["meta"]["distrib_optim_fully_reshardable_mem_efficient"] is True
        assert r["save_calls"] and all(c["gloo"] and not c["all_ranks"] for c in r["save_calls"])
        assert r["opt_equal"] and r["metrics_equal"] and r["params_equal"]
        assert r["plain_meta"]["distrib_optim_fully_reshardable_mem_efficient"] is False
    # the canonical state (fp32 params + both moments) is built on DP rank 0 only
    assert all(c["built"] for c in r0["save_calls"]) and not any(c["built"] for c in r1["save_calls"])
