"""Routing replay end to end on gloo (tiny Qwen3-MoE, bf16 built-in engine vs fp32 trainer).

* ``scripts/moe_routing_replay.py`` (one rank): the trainer's own top-k differs from the engine's on
  some tokens, and replaying the engine's experts lowers the trainer-vs-engine log-prob mismatch.
* EP 2 (alltoall dispatcher): with ``routing_replay="all"`` the old-log-prob pass and the training
  forward both replay, so the first mini-batch's ratio is exactly 1; with ``"old_logprobs"`` only
  the old pass replays and the training forward (own routing) differs from it; a sample without
  routed experts turns replay off for its micro-batch and is counted.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "moe_routing_replay.py"


@pytest.mark.slow  # ~14 s: the benchmark script end to end; the replay modes stay in the default run (EP2 below)
def test_replay_lowers_engine_trainer_mismatch():
    cmd = [sys.executable, str(SCRIPT), "--prompts", "8", "--group", "4", "--max-tokens", "16",
           "--layers", "4", "--seed", "0", "--json"]
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["routing/changed_frac"] > 0.0  # routing actually differs between engine and trainer
    assert res["replay/mismatch/logprob_abs_diff_mean"] < res["off/mismatch/logprob_abs_diff_mean"]
    assert res["replay/mismatch/logprob_abs_diff_max"] < res["off/mismatch/logprob_abs_diff_max"]


def _ep2_worker(rank: int, world: int, d: str) -> dict:
    from megatron_maspo.config import MaspoConfig
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.model.config import ModelConfig
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.config import ParallelConfig
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.train.actor.samples import Sample
    from megatron_maspo.train.components import build_actor
    from megatron_maspo.train.config import TrainConfig

    # transformers saves on the main process only: rank 0 writes, everyone reads after a barrier
    model, hf_cfg = make_tiny_hf_model("qwen3_moe", d if rank == 0 else None, seed=0, num_hidden_layers=4)
    comm.barrier()
    spec = arch_spec_from_hf(hf_cfg)
    groups = init_parallel(ep=2, seed=11)
    cfg = MaspoConfig(model=ModelConfig(routing_replay="all"),
                      parallel=ParallelConfig(ep=2, world_size=world),
                      train=TrainConfig(mini_batches_per_step=1, max_tokens_per_micro_batch=1 << 16))
    actor = build_actor(cfg, spec, groups, init_weights=partial(
        load_hf_weights, spec=spec, groups=groups, source=d))
    engine = BuiltinEngine(copy.deepcopy(model).to(torch.bfloat16), device="cpu")
    engine.record_routing = True
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf_cfg.vocab_size, (8,), generator=g).tolist() for _ in range(8)]
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=0))
    samples = [Sample(prompt_ids=p, response_ids=c.token_ids, advantage=float(j % 2) - 0.5,
                      prompt_index=i, rollout_logprobs=c.logprobs, routed_experts=c.routed_experts)
               for i, (p, cs) in enumerate(zip(prompts, out)) for j, c in enumerate(cs)]
    plans, _, _ = actor.plan(samples)
    res = {}
    for mode in ("all", "old_logprobs"):
        actor.replay_mode = mode
        actor.old_logprobs.fill(samples, plans)
        ctx = actor.forward_backward(samples, plans[0])
        res[mode] = actor.old_logprobs.first_ratio_dev(samples, plans[0], ctx)
    # a sample without routed experts: its micro-batch runs unreplayed, and is counted
    actor.replay_mode = "all"
    samples[0].routed_experts = None
    actor.old_logprobs.fill(samples, plans)
    res["missing"] = actor.replay.missing
    return res


def test_replay_modes_at_ep2(tmp_path):
    r0, r1 = run_workers(_ep2_worker, 2, str(tmp_path))
    for r in (r0, r1):
        assert r["all"] == 0.0  # both passes replay the engine's experts: ρ = 1 exactly
        assert r["old_logprobs"] > 1e-4  # the training forward routes on its own
    # sample 0 sits in one DP rank's only micro-batch: that rank ran it unreplayed
    assert sorted([r0["missing"], r1["missing"]]) == [0, 1]
