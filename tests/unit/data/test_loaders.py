"""Loaders on small files written by the test: DAPO parquet/jsonl, Q/A jsonl, benchmarks, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_maspo.data import DataConfig, SkipLog, load_examples
from megatron_maspo.data.loaders import load_file

DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"ground_truth": "2", "style": "rule-math"},
        "ability": "MATH",
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": "34"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "no answer"}],
        "reward_model": {},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "  "}],
        "reward_model": {"ground_truth": "1"},
    },
]


def _write_jsonl(path: Path, rows: list, extra_lines: list[bytes] = ()) -> Path:
    with path.open("wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")
    return path


def test_dapo_parquet_and_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(DAPO_ROWS), tmp_path / "dapo.parquet")
    string_prompt = {
        "data_source": "d",
        "prompt": "Plain string prompt",
        "reward_model": {"ground_truth": "5"},
    }
    bad = [b"{not json", b'\xff\xfe"bad utf8"']
    jsonl = _write_jsonl(tmp_path / "dapo.jsonl", [*DAPO_ROWS, string_prompt], bad)
    for path, fmt in ((tmp_path / "dapo.parquet", "auto"), (jsonl, "dapo")):
        skips = SkipLog()
        exs = load_file(path, format=fmt, skips=skips)
        assert [e.answer for e in exs][:2] == ["2", "34"]
        assert exs[0].prompt == [{"role": "user", "content": "What is 1+1?"}]
        assert (
            exs[1].prompt[0] == {"role": "system", "content": "s"} and exs[0].source == "math_dapo"
        )
        assert skips.counts["no_answer"] == 1 and skips.counts["empty_prompt"] == 1
        if path.suffix == ".jsonl":
            assert skips.counts["bad_json"] == 1 and skips.counts["undecodable"] == 1
            assert exs[2].prompt == "Plain string prompt" and exs[2].answer == "5"


def test_eval_formats_field_detection(tmp_path: Path) -> None:
    benchmarks = {
        "aime24.jsonl": [{"id": 60, "problem": "Find x.", "answer": 204, "solution": "..."}],
        "math500.jsonl": [
            {"problem": "p", "solution": r"so \boxed{\frac{1}{2}}", "answer": r"\frac{1}{2}"}
        ],
        "minerva.jsonl": [{"problem": "p", "solution": r"thus \boxed{3.2\times10^5}"}],
        "olympiad.jsonl": [{"question": "q", "final_answer": ["$\\frac{1}{2}$", "$3$"]}],
        "amc23.jsonl": [{"question": "q", "answer": 27.0}],
        "plain.jsonl": [
            {"prompt": "q", "ground_truth": "7"},
            {"question": "q2", "answer": ""},
            {"question": "\udcff", "answer": "1"},
            [1, 2],
        ],
    }
    expected = {
        "aime24": "204",
        "math500": r"\frac{1}{2}",
        "minerva": r"3.2\times10^5",
        "olympiad": r"\frac{1}{2}, 3",
        "amc23": "27.0",
        "plain": "7",
    }
    for name, rows in benchmarks.items():
        skips = SkipLog()
        exs = load_file(_write_jsonl(tmp_path / name, rows), format="eval", skips=skips)
        assert exs[0].answer == expected[exs[0].source], name
        if name == "plain.jsonl":
            assert len(exs) == 1
            assert dict(skips.counts) == {"no_answer": 1, "undecodable": 1, "bad_row": 1}
    # A .json file holding {"data": [...]}, and limit.
    (tmp_path / "set.json").write_text(
        json.dumps({"data": [{"problem": f"p{i}", "answer": i} for i in range(5)]})
    )
    cfg = DataConfig(source=str(tmp_path / "set.json"), format="eval", limit=3)
    assert [e.answer for e in load_examples(cfg)] == ["0", "1", "2"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_file(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="extension"):
        load_file(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="format"):
        DataConfig(format="csv")
    with pytest.raises(ValueError, match="ops"):
        DataConfig(ops=("/",))
    with pytest.raises(ValueError, match="prompt_template"):
        DataConfig(prompt_template="no placeholder")


def test_reasoning_gym_if_installed() -> None:
    pytest.importorskip("reasoning_gym")
    cfg = DataConfig(source="reasoning_gym:basic_arithmetic", num_examples=3, seed=1)
    a, b = load_examples(cfg), load_examples(cfg)
    assert len(a) == 3 and [e.answer for e in a] == [e.answer for e in b]
