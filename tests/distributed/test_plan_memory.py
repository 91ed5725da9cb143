"""The planner's per-category memory against what ``train/actor/offload.py`` actually moves on a CPU run.

A tiny model is built and trained one step by the real actor (Megatron DDP, optimizer, frozen reference
model; fp32 on 1 gloo rank, bf16 with fp32 master copies and the distributed optimizer on 2); the offloader then moves every category and reports its bytes
per rank. The planner, given the same config and architecture, must predict those bytes per category:
its figures are the ones ``maspo plan`` subtracts from the rollout peak and reports as host memory.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.launch.plan import GIB, estimate, layout_of
from megatron_maspo.model.spec import tiny_qwen2_spec
from megatron_maspo.train.actor.offload import CATEGORIES, StateOffloader, training_tensors
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Shapes that are multiples of 64 (vocab 1000 pads to 1024), so Megatron's buffer alignment adds nothing
# and the figures must agree to the byte, except Adam's per-parameter ``step`` scalars (a few bytes each,
# which the planner does not count).
SPEC = dataclasses.replace(tiny_qwen2_spec(1000, num_layers=2, hidden_size=256), ffn_hidden_size=704)
STEP_SCALARS = 4096


def _worker(rank: int, world: int, bf16: bool, dist_opt: bool, reference: bool) -> dict:
    # bf16: bf16 params + fp32 master copies (the GPU default)
    actor = H.build_actor(world, spec=SPEC, dist_opt=dist_opt, reference_model=reference, bf16=bf16)
    actor.train_step(H.make_samples(seed=1))  # Adam state exists only after the first step
    off = StateOffloader(lambda: training_tensors(actor.chunks, actor.optimizer, actor.reference or ()),
                         enabled=CATEGORIES, device=actor.device)
    moved = off.offload()
    off.reload()
    return {"by_cat": dict(off.bytes_by_category), "moved": moved, "cfg": H.make_cfg(world, dist_opt=dist_opt, reference_model=reference, bf16=bf16)}


CASES = {"1rank_fp32_reference": (1, False, False, True),
         "dp2_distopt_bf16": (2, True, True, False)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("dp2") else c
                                  for c in CASES])
def test_planner_category_bytes_match_what_the_offloader_moves(case):
    world, bf16, dist_opt, reference = CASES[case]
    results = run_workers(_worker, world, bf16, dist_opt, reference)
    cfg = dataclasses.replace(results[0]["cfg"], train=dataclasses.replace(
        results[0]["cfg"].train, offload_params=True, offload_grads=True, offload_optimizer=True))
    cfg.model.bf16 = bf16
    plan = estimate(cfg, SPEC, layout_of(cfg), nodes=1, gpus_per_node=world)
    planned = {c: g * GIB for c, g in plan.memory.offloaded.items()}
    for res in results:
        measured = res["by_cat"]
        assert res["moved"] == sum(measured.values())
        for c in CATEGORIES:
            assert planned[c] <= measured[c] <= planned[c] + STEP_SCALARS, (c, planned[c], measured[c])
        assert plan.memory.host * GIB == pytest.approx(sum(planned.values()))
