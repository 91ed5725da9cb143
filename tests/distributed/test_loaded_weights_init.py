"""An actor whose weights are loaded right after the build skips Megatron's full unsharded CPU draw
(issue 29, defect 8c): ``use_cpu_initialization`` only for kept random weights (the tiny recipe's)."""

from __future__ import annotations

import torch

from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers


def _worker(rank: int, world: int) -> dict:
    from megatron.core.tensor_parallel import layers

    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.train.components import build_actor, build_inference_policy

    full_draws: list[tuple[int, ...]] = []
    orig = layers._initialize_affine_weight_cpu

    def spy(weight, output_size, input_size, *a, **k):
        full_draws.append((output_size, input_size))
        return orig(weight, output_size, input_size, *a, **k)

    layers._initialize_affine_weight_cpu = spy
    spec = H.qwen2_spec()
    groups = init_parallel(seed=11)
    cfg = H.make_cfg(world, reference_model=True)
    out = {}
    build_actor(cfg, spec, groups)  # Megatron's seeded initialisation is kept: the full draw stays
    out["random"] = len(full_draws)
    full_draws.clear()
    loaded = build_actor(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    build_inference_policy(cfg, spec, groups, init_weights=H.name_init(spec, groups))
    out["loaded"] = len(full_draws)
    out["cpu_init"] = [c.module.config.use_cpu_initialization for c in loaded.chunks]
    ref = {n: p for c in loaded.reference for n, p in c.named_parameters()}
    out["ref_equal"] = all(torch.equal(ref[n], p) for c in loaded.chunks
                           for n, p in c.module.named_parameters())
    return out


def test_loaded_weights_skip_the_full_cpu_draw():
    (r,) = run_workers(_worker, 1, timeout_s=300)
    assert r["random"] > 0  # kept random weights: identical at every TP, drawn in full
    assert r["loaded"] == 0 and r["cpu_init"] == [False]
    assert r["ref_equal"]  # the reference model is a copy of the loaded weights
