"""``rollout.max_staleness`` end to end: k = 0 is the synchronous loop, and a run with k > 0 resumes
from a checkpoint with its pending batches exactly as if it had never stopped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import MICRO, _cmd, _comparable, _metrics, _run, _run_concurrently

# MICRO trains on all-equal rewards (gradient 0). LEARNING gives non-zero advantages: a longer warm
# start makes some responses stop early, and the overlong penalty then grades them by length.
LEARNING = [*MICRO, "model.tiny_hidden_size=64", "train.sft_steps=40", "rollout.max_new_tokens=8",
            "train.overlong_buffer=4"]
STALE = ["rollout.max_staleness=2", "loss.tis_cap=2.0"]

# Runs the loop with the queue forced on at k = 0: the generate-ahead machinery with nothing ahead.
_FORCED_QUEUE = """
import sys
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.parallel.groups import destroy_parallel
from megatron_maspo.train.loop import Trainer
from megatron_maspo.train.rollouts.staleness import StalenessQueue

t = Trainer(resolve_config(None, None, sys.argv[1:]))
assert t.rollouts.queue is None, "k = 0 must not build the queue"
t.rollouts.queue = StalenessQueue(0)
t.run()
assert len(t.rollouts.queue) == 0
destroy_parallel()
"""


def _check_k0_is_synchronous(base: list[str], tmp_path: Path) -> list[dict]:
    sync, forced = tmp_path / "sync", tmp_path / "forced"
    a, b = _run_concurrently(  # the plain loop and the forced-queue loop, side by side
        _cmd(sets=[*base, "train.steps=3", "rollout.max_staleness=0", f"checkpoint.run_dir={sync}"]),
        [sys.executable, "-c", _FORCED_QUEUE, *base, "train.steps=3", f"checkpoint.run_dir={forced}"])
    assert a.returncode == 0, a.stderr[-3000:]
    assert b.returncode == 0, b.stderr[-3000:]
    ra, rb = _metrics(sync), _metrics(forced)
    assert len(ra) == 3 and not any(k.startswith("rollout/staleness") for k in ra[0])  # no new keys at k=0
    assert all(r.pop("rollout/staleness_max") == 0 and r.pop("rollout/staleness_mean") == 0 for r in rb)
    assert all(r.pop("rollout/tokens_stale_0") > 0 for r in rb)
    assert [_comparable(r) for r in ra] == [_comparable(r) for r in rb]
    return ra


def _check_resume_with_pending_batches(base: list[str], tmp_path: Path) -> list[dict]:
    full, part = tmp_path / "full", tmp_path / "part"
    a = _run(sets=[*base, *STALE, "train.steps=4", "checkpoint.save_every=2", f"checkpoint.run_dir={full}"])
    assert a.returncode == 0, a.stderr[-3000:]
    b = _run(sets=[*base, *STALE, "train.steps=2", "checkpoint.save_every=2", f"checkpoint.run_dir={part}"])
    assert b.returncode == 0, b.stderr[-3000:]
    c = _run("--resume", str(part), sets=["train.steps=4"])  # steps 3, 4 train batches made before the stop
    assert c.returncode == 0, c.stderr[-3000:]
    ra, rc = _metrics(full), _metrics(part)
    assert [r["rollout/staleness_max"] for r in ra] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/policy_version"] for r in ra] == [2.0, 3.0, 4.0, 5.0]
    for r in ra:  # every response token is counted under exactly one lag
        lag = int(r["rollout/staleness_max"])
        assert r[f"rollout/tokens_stale_{lag}"] > 0
        assert sum(r[f"rollout/tokens_stale_{d}"] for d in range(3)) == r[f"rollout/tokens_stale_{lag}"]
    assert [_comparable(r) for r in ra] == [_comparable(r) for r in rc]
    # mismatch/* only from fresh samples (step 1), offpolicy/* from stale ones (steps 2-4)
    assert ["mismatch/kl_k3" in r for r in ra] == [True, False, False, False]
    assert ["offpolicy/kl_k3" in r for r in ra] == [False, True, True, True]
    # Dropping the queue on resume would silently skip generated batches: a one-line error instead.
    d = _run("--resume", str(part), sets=["train.steps=5", "rollout.max_staleness=0"])
    assert d.returncode == 2 and "resume it with the same rollout.max_staleness" in d.stderr, d.stderr[-2000:]
    return ra


def test_staleness_zero_is_the_synchronous_loop(tmp_path):
    _check_k0_is_synchronous(MICRO, tmp_path)


@pytest.mark.slow  # ~40-50 s on 2 cores; the queue's checkpoint round trip stays in tests/unit/train/test_staleness.py
def test_resume_keeps_the_pending_stale_batches(tmp_path):
    _check_resume_with_pending_batches(MICRO, tmp_path)


@pytest.mark.slow
def test_k0_and_resume_with_real_gradients(tmp_path):
    """The two checks above on a run whose updates change the policy (non-zero gradient, TIS weights
    away from 1), so a lost or regenerated batch would show in the metrics."""
    ra = _check_k0_is_synchronous(LEARNING, tmp_path / "k0")
    assert any(r["actor/grad_norm"] > 0 for r in ra), [r["actor/grad_norm"] for r in ra]
    rs = _check_resume_with_pending_batches(LEARNING, tmp_path / "k2")
    assert any(r["actor/grad_norm"] > 0 for r in rs)
    assert any(abs(r["tis/weight_mean"] - 1) > 1e-4 for r in rs[2:])  # stale batches: IS weight acts
