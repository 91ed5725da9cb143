"""``maspo train`` on a tiny Qwen3-MoE, seed 7: TP 2 x EP 2 on 4 gloo ranks (torchrun) trains one step
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


def _train(src, run, *, nproc: int, sets: list[str]) -> dict:
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    cmd = [*head, "-m", "megatron_maspo.cli.main", "train"]
    for s in [f"model.source={src}", f"checkpoint.run_dir={run}", *SETS, *sets]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rec


def test_tp2_ep2_one_step_equals_one_rank(tmp_path):
    from megatron_maspo.data.tokenizer import build_byte_tokenizer
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    src = tmp_path / "model"
    tok = build_byte_tokenizer()
    make_tiny_hf_model("qwen3_moe", src, vocab_size=len(tok), seed=0)
    tok.save_pretrained(src)
    one = _train(src, tmp_path / "one", nproc=1, sets=[])
    four = _train(src, tmp_path / "four", nproc=4, sets=["parallel.tp=2", "parallel.ep=2"])
    assert one["actor/grad_norm"] > 0  # a learning step, not an all-equal-reward batch
    assert four["reward/mean"] == one["reward/mean"]
    for k in ("actor/loss", "actor/grad_norm"):
        assert math.isclose(four[k], one[k], rel_tol=1e-4), (k, four[k], one[k])
