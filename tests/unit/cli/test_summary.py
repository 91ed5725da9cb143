"""The end-of-run summary: reward and accuracy first -> last, time, where everything is, what to run next."""

from __future__ import annotations

import json

from megatron_maspo.cli.summary import run_summary


def test_summary_of_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    rows = [{"step": 1, "reward/mean": -0.5, "reward/accuracy": 0.25},
            {"step": 2, "eval/accuracy": 0.1},  # a held-out row: not a training step
            {"step": 3, "reward/mean": 0.25, "reward/accuracy": 0.625}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    lines = run_summary(run, 90.0)
    assert lines[0] == "done: steps 1-3 in 1.5 min, reward -0.500 -> +0.250, accuracy 0.25 -> 0.62 (first -> last step)"
    text = "\n".join(lines)
    for needle in (f"metrics:     {run / 'metrics.jsonl'}", f"plots:       {run / 'plots'}",
                   f"checkpoints: {run / 'checkpoints'}", f"maspo train --resume {run} --set train.steps=N",
                   f"maspo eval {run}"):
        assert needle in text, text
    assert "TensorBoard" not in text  # no tb/ folder: not pointed to


def test_an_empty_run_directory_only_points_at_what_exists(tmp_path):
    assert run_summary(tmp_path, 1.0) == []
