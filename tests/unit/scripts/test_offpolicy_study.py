"""``scripts/offpolicy_study.py``: per-run summaries, tables and the doc block, on hand-made metrics
(the runs themselves are ``maspo train`` processes, covered by the e2e tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _run_dir(tmp_path: Path, name: str, rewards: list[float], entropy: list[float], gate: float) -> Path:
    d = tmp_path / name
    d.mkdir()
    rows = [{"step": i + 1, "reward/mean": r, "entropy/mean": e, "gate/w_lt_0.9_frac": gate,
             "clip/frac_pos": 0.01, "clip/frac_neg": 0.02, "time/step": 1.0}
            for i, (r, e) in enumerate(zip(rewards, entropy))]
    rows.append({"step": len(rows), "eval/average/avg@2": 0.5})  # eval rows are ignored
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def test_summary_gain_gate_clip_and_collapse(study, tmp_path):
    ok = study.summarise(_run_dir(tmp_path, "a", [0.0, 0.1, 0.2, 0.5, 0.6, 0.7], [1.0] * 6, 0.02), window=2)
    assert ok["steps"] == 6 and ok["gain"] == pytest.approx(0.65 - 0.05)
    assert ok["gate_w_lt_0p9"] == pytest.approx(0.02) and ok["clip_frac"] == pytest.approx(0.03)
    assert not ok["collapsed"] and ok["tis_weight"] != ok["tis_weight"]  # NaN: TIS off
    worse = study.summarise(_run_dir(tmp_path, "b", [0.5, 0.5, 0.4, 0.2, 0.1, 0.1], [1.0] * 6, 0.0), window=2)
    assert worse["collapsed"]
    flat = study.summarise(_run_dir(tmp_path, "c", [0.1] * 6, [1.0, 1.0, 0.5, 0.3, 0.1, 0.1], 0.0), window=2)
    assert flat["collapsed"]  # entropy fell below a quarter of its start


def test_tables_and_doc_block_are_rewritten_in_place(study, tmp_path):
    r = study.summarise(_run_dir(tmp_path, "a", [0.0, 0.2, 0.4, 0.6], [1.0] * 4, 0.05), window=2)
    results = {"16:2": {"maspo": {1: r, 2: r}}}
    table = study.tables(results)
    assert "| 16:2 | maspo | 1 | +0.400 |" in table and "| 16:2 | maspo | 2 | +0.400 ± 0.000 | 5.00% |" in table
    doc = tmp_path / "docs" / "study.md"
    doc.parent.mkdir()
    doc.write_text(f"# Study\n\nintro\n\n{study.BEGIN}\nold\n{study.END}\n\nanalysis\n")
    study.write_doc(doc, table, [], "python scripts/offpolicy_study.py --seeds 1 2")
    text = doc.read_text()
    assert "old" not in text and "intro" in text and "analysis" in text and table in text
    assert "Produced by `python scripts/offpolicy_study.py --seeds 1 2`" in text
    # A named block (an lr sweep) is added beside the main one and leaves it untouched.
    study.write_doc(doc, "sweep table", [], "python scripts/offpolicy_study.py --block lr", block="lr")
    text2 = doc.read_text()
    begin, end = study.markers("lr")
    assert table in text2 and text2.index(begin) < text2.index("sweep table") < text2.index(end)
    study.write_doc(doc, "sweep table 2", [], "python scripts/offpolicy_study.py --block lr", block="lr")
    assert "sweep table 2" in doc.read_text() and "sweep table\n" not in doc.read_text()


def test_bad_condition_is_a_usage_error(study):
    with pytest.raises(SystemExit):
        study.main(["--conditions", "16-2", "--out", "/nonexistent/never"])
