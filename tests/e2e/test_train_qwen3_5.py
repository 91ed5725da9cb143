"""``maspo train`` on tiny Qwen3.5 HF folders under torchrun (2 gloo ranks, built-in engine with
transformers' hybrid cache): dense at TP 2, MoE at EP 2, 3 RL steps each after a short SFT warm start
(so advantages are non-zero). Every loss is finite, the first mini-batch's ratio is exactly 1 (the
trainer's packed GDN reproduces the old log-probs), and the engine's log-probs agree with the
trainer's after every weight sync."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("family,layout", [("qwen3_5", "parallel.tp=2"), ("qwen3_5_moe", "parallel.ep=2")])
def test_three_rl_steps_under_torchrun(tmp_path, family, layout):
    from megatron_maspo.data.tokenizer import build_byte_tokenizer
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    src, run = tmp_path / "model", tmp_path / "run"
    tok = build_byte_tokenizer()
    make_tiny_hf_model(family, src, vocab_size=len(tok), seed=0)
    tok.save_pretrained(src)
    sets = [f"model.source={src}", f"checkpoint.run_dir={run}", "train.steps=3", "train.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=8", "train.sft_steps=8", "train.overlong_buffer=4",
            "data.num_examples=32", "logging.tensorboard=false", "logging.plots=false", "reward.num_workers=1",
            "train.max_tokens_per_micro_batch=256", "train.check_first_ratio=true", layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_maspo.cli.main", "train"] + [x for s in sets for x in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]), r
        assert r["actor/first_ratio_max_abs_dev"] < 1e-5, r
        assert r["mismatch/logprob_abs_diff_max"] < 1e-4, r
    assert any(r["actor/grad_norm"] > 0 for r in rows), "no learning signal: the test would not see a sync"
