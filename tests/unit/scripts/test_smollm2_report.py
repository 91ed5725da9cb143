"""``scripts/smollm2_report.py``: per-run summaries, the table and the doc block, on hand-made metrics
(the runs are ``maspo train --recipe smollm2`` processes; the recipe itself is loaded in the recipe tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _run(tmp_path: Path, name: str, before: float, after: float | None, rewards: list[float]) -> Path:
    d = tmp_path / name
    d.mkdir()
    rows = [{"step": 0, "eval/average/avg@4": before, "eval/average/pass@4": 0.7, "eval/seconds": 1.0}]
    for i, r in enumerate(rewards):
        rows.append({"step": i + 1, "reward/mean": r, "reward/accuracy": (r + 1) / 2, "entropy/mean": 0.5 - 0.01 * i,
                     "response_length/mean": 20.0, "mismatch/kl_k3": 1e-8, "mismatch/logprob_abs_diff_max": 1e-5,
                     "gate/w_lt_0.9_frac": 0.01, "clip/frac_pos": 0.0, "clip/frac_neg": 0.0, "time/step": 90.0})
    if after is not None:
        rows.append({"step": len(rewards), "eval/average/avg@4": after, "eval/average/pass@4": 0.8})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def test_summary_reads_eval_before_and_after(report, tmp_path):
    s = report.summarize(_run(tmp_path, "maspo_seed2", 0.375, 0.5, [-0.2, 0.0, 0.2]))
    assert (s["method"], s["seed"], s["k"], s["steps"]) == ("maspo", 2, 4, 3)
    assert (s["avg_before"], s["avg_after"], s["pass_before"], s["pass_after"]) == (0.375, 0.5, 0.7, 0.8)
    assert s["eval_steps"] == [0, 3] and s["reward"] == [-0.2, 0.0, 0.2] and s["step_s"] == 90.0


def test_table_and_doc_block(report, tmp_path):
    runs = [report.summarize(_run(tmp_path, "maspo_seed1", 0.4, 0.5, [0.0] * 4)),
            report.summarize(_run(tmp_path, "maspo_seed2", 0.3, 0.6, [0.0] * 4)),
            report.summarize(_run(tmp_path, "grpo_seed1", 0.4, None, [0.0] * 4))]  # unfinished: no after
    t = report.table(runs)
    assert "| maspo | 2 | 0.350 → 0.550 | +0.100, +0.300 |" in t
    assert "| grpo | 1 | 0.400 → – |" in t and "| grpo | 0 |" not in t
    doc = tmp_path / "smol.md"
    doc.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    report.write_doc(doc, t, None, "python scripts/smollm2_report.py x")
    text = doc.read_text()
    assert "old" not in text and "intro" in text and "after" in text and t in text


def test_run_without_step0_eval_is_refused(report, tmp_path):
    d = tmp_path / "grpo_seed1"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
    with pytest.raises(ValueError, match="eval at step 0"):
        report.summarize(d)
    with pytest.raises(ValueError, match="method>_seed"):
        report.summarize(tmp_path)
