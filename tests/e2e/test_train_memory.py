"""``maspo train`` logs ``memory/*`` for every phase, and offloading the training state during generation
changes no metric (CPU: offload is a copy to a second buffer and back)."""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_train_cli import MICRO, _comparable, _metrics, _run

PHASES = ("generate", "grade", "old_logprobs", "train", "sync")
OFFLOAD = ["train.offload_params=true", "train.offload_grads=true", "train.offload_optimizer=true"]
BASE = [*MICRO, "train.steps=2", "checkpoint.save_every=0", "train.sft_steps=1"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _offloaded_run(run_dir) -> list[dict]:
    out = _run(sets=[*BASE, *OFFLOAD, f"checkpoint.run_dir={run_dir}"])
    assert out.returncode == 0, out.stderr[-3000:]
    return _metrics(run_dir)


@pytest.mark.slow  # the default run checks the same metrics on test_colocation_loop.py's offloaded run
def test_memory_metrics_for_every_phase_with_offload(tmp_path):
    recs = _offloaded_run(tmp_path / "off")
    assert len(recs) == 2
    for rec in recs:
        for phase in PHASES:
            for kind in ("peak_rss", "rss"):
                v = rec[f"memory/{phase}_{kind}_gb"]
                assert 0.01 < v < 64, (phase, kind, v)  # a Python process with torch holds > 10 MB
        assert rec["memory/offloaded_gb"] > 0


@pytest.mark.slow
def test_offload_changes_no_metric(tmp_path):
    plain = tmp_path / "plain"
    a = _run(sets=[*BASE, f"checkpoint.run_dir={plain}"])
    assert a.returncode == 0, a.stderr[-3000:]
    ra, rb = _metrics(plain), _offloaded_run(tmp_path / "off")
    assert all(r["memory/offloaded_gb"] == 0 for r in ra)
    for x, y in zip(ra, rb, strict=True):
        assert _same(_comparable(x), _comparable(y)), "offload must not change training"
