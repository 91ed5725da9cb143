"""Qwen3-MoE on gloo: Megatron's alltoall dispatcher (through the CPU ``a2a`` shim) reproduces the
allgather dispatcher's log-probs and gradients at EP 2 and EP 4.

Same weights (name-based init), same samples; the allgather run pads rows to equal length over the
EP group, the alltoall run does not (so the two also differ in packing, and must still agree).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_maspo.parallel.groups import init_parallel
from megatron_maspo.train.components import build_actor
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(world: int, ep: int, dispatcher: str) -> dict:
    spec = H.qwen3_moe_spec()
    groups = init_parallel(ep=ep, seed=11)
    cfg = H.make_cfg(world, ep=ep)
    cfg.model.moe_dispatcher = dispatcher
    actor = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    samples = H.make_samples()
    out = {"dispatcher": actor.chunks[0].config.moe_token_dispatcher_type,
           "lp": actor.compute_logprobs(samples)[0]}
    plans, _, _ = actor.plan(samples)
    rows: list = [None] * world
    dist.all_gather_object(rows, [int(mb.tokens.numel()) for p in plans for mb in p.micro_batches])
    out["row_lens"] = rows
    actor.old_logprobs.fill(samples, plans)
    ctx = actor.forward_backward(samples, plans[0])
    out["loss"] = actor._reduce_metrics(ctx.metrics)["actor/loss"]
    out["grads"] = H.full_tensors(actor, grads=True)
    return out


def _worker(rank: int, world: int, ep: int) -> dict:
    res = {d: _run(world, ep, d) for d in ("allgather", "alltoall")}
    return res if rank == 0 else {}


def _rel_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> bool:
    """|a - b| <= rel * max|b| (elementwise relative to the tensor's scale: exact zeros stay exact)."""
    return float((a - b).abs().max()) <= rel * max(float(b.abs().max()), 1e-12)


def _check(res: dict) -> None:
    ag, a2a = res["allgather"], res["alltoall"]
    assert (ag["dispatcher"], a2a["dispatcher"]) == ("allgather", "alltoall")
    # allgather pads micro-batch k of every EP rank to one length; alltoall keeps rows as packed
    assert all(len(set(col)) == 1 for col in zip(*ag["row_lens"]))
    assert any(len(set(col)) > 1 for col in zip(*a2a["row_lens"]))
    for x, y in zip(a2a["lp"], ag["lp"]):
        assert x.shape == y.shape and _rel_close(x, y), (x - y).abs().max()
    assert abs(a2a["loss"] - ag["loss"]) <= 1e-6 * abs(ag["loss"])
    assert a2a["grads"].keys() == ag["grads"].keys()
    assert any("local_experts.3." in k for k in ag["grads"])
    for k in ag["grads"]:
        assert _rel_close(a2a["grads"][k], ag["grads"][k]), (k, (a2a["grads"][k] - ag["grads"][k]).abs().max())


def test_alltoall_matches_allgather_ep2():
    _check(run_workers(_worker, 2, 2)[0])


@pytest.mark.slow  # ~40-50 s on 2 cores; EP 2 stays in the default run
def test_alltoall_matches_allgather_ep4():  # 4 ranks, ~14 s on 2 cores
    _check(run_workers(_worker, 4, 4)[0])
