"""``maspo eval``'s inference-only policy loads the actor's checkpoint without training state."""

from __future__ import annotations

import torch

from tests.distributed._actor_helpers import make_cfg, make_samples, name_init, qwen2_spec
from tests.distributed._launch import run_workers


def _worker(rank: int, world: int, ckpt: str) -> dict:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_maspo.train.components import build_actor, build_inference_policy

    cfg, spec = make_cfg(world, tp=2), qwen2_spec()
    groups = init_parallel(tp=2)
    actor = build_actor(cfg, spec, groups, init_weights=name_init(spec, groups))
    actor.train_step(make_samples())  # weights move away from the init
    save_checkpoint(actor, ckpt, step=1)
    trained = {k: v.detach().clone() for k, v in actor.named_modules_unwrapped()[0].state_dict().items()
               if isinstance(v, torch.Tensor)}
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for c in actor.chunks
                     for b in c.buffers)
    policy = build_inference_policy(cfg, spec, groups, init_weights=name_init(spec, groups))
    load_checkpoint(policy, f"{ckpt}/step_1", load_optimizer=False)
    (model,) = policy.named_modules_unwrapped()
    same = all(torch.equal(v, trained[k]) for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor) and k in trained)
    return {"same": same, "steps_done": (policy.steps_done, actor.steps_done), "training": model.training,
            "requires_grad": any(p.requires_grad for p in model.parameters()),
            "main_grad": any(hasattr(p, "main_grad") for p in model.parameters()),
            "policy_bytes": policy.num_bytes(), "actor_grad_bytes": grad_bytes}


def test_inference_policy_loads_the_actor_checkpoint(tmp_path):
    for r in run_workers(_worker, 2, str(tmp_path / "ckpt"), timeout_s=600):
        assert r["same"] and r["steps_done"][0] == r["steps_done"][1] > 0
        assert not (r["training"] or r["requires_grad"] or r["main_grad"])
        # the actor's fp32 gradient buffer alone is as large as the policy's fp32 weights
        assert r["actor_grad_bytes"] >= r["policy_bytes"] * 0.9
