"""``maspo train`` on a tiny Qwen3-MoE HF folder with the built-in engine: routing replay on, the aux
loss configured, ``moe/*`` and ``mismatch/*`` metrics in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_moe_run_logs_moe_metrics(tmp_path):
    from megatron_maspo.data.tokenizer import build_byte_tokenizer
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    src, run = tmp_path / "model", tmp_path / "run"
    tok = build_byte_tokenizer()
    make_tiny_hf_model("qwen3_moe", src, vocab_size=len(tok), seed=0)
    tok.save_pretrained(src)
    sets = [f"model.source={src}", f"checkpoint.run_dir={run}", "train.steps=1", "train.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=8", "train.sft_steps=0", "data.num_examples=32",
            "logging.tensorboard=false", "logging.plots=false", "reward.num_workers=1",
            "train.max_tokens_per_micro_batch=256", "model.routing_replay=all",
            "model.moe_load_balancing=aux_loss", "model.moe_aux_loss_coeff=0.001", "model.moe_z_loss_coeff=0.001"]
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"] + [x for s in sets for x in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for k in ("moe/load_imbalance", "moe/dropped_frac", "moe/router_entropy", "moe/aux_loss", "moe/z_loss"):
        assert k in rec, k
    assert rec["moe/replay_missing_mb"] == 0.0  # every sample carried the engine's experts
    assert rec["moe/load_imbalance"] >= 1.0 and rec["moe/aux_loss"] > 0 and rec["moe/z_loss"] > 0
    # fp32 engine and trainer, experts replayed: log-probs agree to float rounding
    assert rec["mismatch/logprob_abs_diff_mean"] < 1e-5
