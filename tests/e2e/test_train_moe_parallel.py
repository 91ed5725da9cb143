"""MoE runs of ``maspo train`` under torchrun (slow).

``maspo train`` on a tiny Qwen3-MoE and a tiny DeepSeek-V3, seed 7: TP 2 x EP 2 on 4 gloo ranks (torchrun) trains one step
with the same ``reward/mean`` as one rank, and ``actor/loss`` / ``actor/grad_norm`` within 1e-4 relative.

Sequence parallelism is not set: ``parallel.sequence_parallel`` defaults to None, which turns it on for
an MoE model at TP > 1 (the local spec's SP torch norms, ``model/sp_norm.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]  # ~2 min on 2 cores

SETS = ["train.seed=7", "train.steps=1", "train.prompts_per_step=8", "train.sft_steps=40",
        "logging.tensorboard=false", "logging.plots=false"]


def _train(src, run, *, nproc: int, sets: list[str]) -> dict | list[dict]:
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    cmd = [*head, "-m", "megatron_maspo.cli.main", "train"]
    for s in [f"model.source={src}", f"checkpoint.run_dir={run}", *SETS, *sets]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return recs[0] if len(recs) == 1 else recs


def _tiny_folder(family: str, src):
    from megatron_maspo.data.tokenizer import build_byte_tokenizer
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    tok = build_byte_tokenizer()
    make_tiny_hf_model(family, src, vocab_size=len(tok), seed=0)
    tok.save_pretrained(src)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_tp2_ep2_one_step_equals_one_rank(tmp_path, family):
    src = tmp_path / "model"
    _tiny_folder(family, src)
    one = _train(src, tmp_path / "one", nproc=1, sets=[])
    four = _train(src, tmp_path / "four", nproc=4, sets=["parallel.tp=2", "parallel.ep=2"])
    assert one["actor/grad_norm"] > 0  # a learning step, not an all-equal-reward batch
    assert four["reward/mean"] == one["reward/mean"]
    for k in ("actor/loss", "actor/grad_norm"):
        assert math.isclose(four[k], one[k], rel_tol=1e-4), (k, four[k], one[k])


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_rl_loop_three_steps_at_ep2(tmp_path, family):
    """The GLM-4.5 / DeepSeek-V3 tiny model in the RL loop under torchrun at EP 2 (2 ranks) with routing
    replay: finite losses, the step-0 ratio exactly 1 on every step, and the engine's log-probs equal the
    trainer's to float rounding (its weights are the trainer's export: checksummed buckets, fp32 both sides)."""
    src = tmp_path / family
    _tiny_folder(family, src)
    recs = _train(src, tmp_path / "run", nproc=2,
                  sets=["parallel.ep=2", "train.steps=3", "train.sft_steps=60", "train.check_first_ratio=true",
                        "rollout.verify_checksums=true", "model.routing_replay=all"])
    assert len(recs) == 3
    for r in recs:
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"])
        assert r["actor/first_ratio_max_abs_dev"] == 0.0
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-5
    assert any(r["actor/grad_norm"] > 0 for r in recs)
    # the engine's experts (MoE layers only: layer 0 is dense) replayed in every RL micro-batch; the first
    # record also counts the SFT warm-up's micro-batches, which have no engine routing
    assert [r["moe/replay_missing_mb"] for r in recs[1:]] == [0.0, 0.0]
