"""GPU: Megatron-Core's context parallelism through Transformer Engine's attention (thd, p2p ring by
default, ``parallel.cp_comm_type``) against ``packed_sdpa`` at CP 1, through the actor in bf16.
Written for a 2-GPU machine; not run on the CPU machine this project is developed on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.te, pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(world: int, backend: str, cp: int, comm_type: str) -> dict:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor

    cfg = H.make_cfg(world, budget=72 // cp)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=cp, cp_comm_type=comm_type))
    cfg.model.attention_backend = backend
    cfg.model.bf16 = True
    spec = H.qwen2_spec()
    groups = init_parallel(cp=cp, seed=11)
    actor = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    samples = H.make_samples()
    plans, _, _ = actor.plan(samples)
    out = {"lp": actor.compute_logprobs(samples)[0]}
    actor.old_logprobs.fill(samples, plans)
    ctx = actor.forward_backward(samples, plans[0])
    out["loss"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
    return out


def _worker(rank: int, world: int, backend: str, cp: int, comm_type: str) -> dict:
    res = _run(world, backend, cp, comm_type)
    return res if rank == 0 else {}


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_te_cp2_matches_packed_sdpa_cp1(comm_type):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ref = run_workers(_worker, 1, "packed_sdpa", 1, "p2p", backend="nccl")[0]
    got = run_workers(_worker, 2, "te", 2, comm_type, backend="nccl")[0]
    for x, y in zip(got["lp"], ref["lp"]):
        torch.testing.assert_close(x, y, rtol=0, atol=3e-2)  # bf16 kernels, other summation order
    assert abs(got["loss"] - ref["loss"]) <= 3e-2 * max(1.0, abs(ref["loss"]))
