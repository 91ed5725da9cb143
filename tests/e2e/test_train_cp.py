"""``maspo train`` at CP 2 under torchrun (gloo) against one rank, from the same warm-started weights.

The done-when check of context parallelism end to end, at a small size: a 1-rank run saves its SFT
warm start (``checkpoint.save_warm_start``: ``checkpoints/step_0``); a 1-rank run and a
``torchrun --nproc-per-node 2 ... --set parallel.cp=2`` run both start from it
(``model.megatron_checkpoint``, ``train.sft_steps=0``) and train one step. The CP run has two engines
(one per rank) generating half the prompts each, seeded by global prompt position, so its rewards
equal the 1-rank run's exactly; loss and grad norm agree within 1e-4 relative (the CP attention sums
in another order). Without the shared warm start the SFT steps amplify that rounding into other
weights and other samples (docs/attention.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import _metrics

pytestmark = pytest.mark.slow  # three trainer starts, one of them 2 ranks: ~60-90 s on 2 shared cores

RTOL = 1e-4
# Small, yet with a learning signal: 80 SFT steps teach a 1-layer model the boxed-answer format often enough
# that some groups hold a correct answer (MICRO's 6 new tokens cannot hold one: loss and grads would be 0).
SMALL = ["model.tiny_num_layers=1", "model.tiny_hidden_size=32", "train.prompts_per_step=8",
         "rollout.group_size=8", "data.num_examples=64", "train.sft_steps=80", "reward.num_workers=1",
         "logging.tensorboard=false", "logging.plots=false", "train.steps=1"]


def _train(run_dir: Path, *sets: str, nproc: int = 1) -> None:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(nproc)] if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "megatron_maspo.cli.main", "train"]
    for s in [*SMALL, f"checkpoint.run_dir={run_dir}", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def test_cp2_first_step_matches_one_rank_from_the_same_warm_start(tmp_path):
    _train(tmp_path / "warm", "checkpoint.save_warm_start=true")
    warm = tmp_path / "warm" / "checkpoints" / "step_0"
    assert (warm / "metadata.json").is_file()
    shared = ["train.sft_steps=0", f"model.megatron_checkpoint={warm}"]
    _train(tmp_path / "one", *shared)
    _train(tmp_path / "cp2", *shared, "parallel.cp=2", nproc=2)
    (a,), (b,) = _metrics(tmp_path / "one"), _metrics(tmp_path / "cp2")
    assert b["rollout/engines"] == 2 and a["rollout/engines"] == 1
    assert a["reward/accuracy"] > 0 and a["actor/loss"] != 0 and a["actor/grad_norm"] > 0  # not a no-op step
    # the same samples: every reward figure and the response lengths, exactly
    same = sorted(k for k in a if k.startswith(("reward/", "response_length/")))
    assert len(same) > 3 and {k: a[k] for k in same} == {k: b[k] for k in same}
    for key in ("actor/loss", "actor/grad_norm"):
        assert _rel(a[key], b[key]) <= RTOL, (key, a[key], b[key])
