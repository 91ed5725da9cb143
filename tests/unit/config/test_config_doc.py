"""``docs/config.md`` is generated from the config dataclasses and must be current."""

from __future__ import annotations

from pathlib import Path

from megatron_maspo.config_doc import config_markdown, field_docs
from megatron_maspo.reward.config import RewardConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.read_text() == config_markdown(), (
        "docs/config.md is stale: python -m megatron_maspo.config_doc > docs/config.md")


def test_field_docs_are_read_from_the_source():
    docs = field_docs(RewardConfig)
    assert docs["max_bad_fraction"].startswith("Stop the run with one line naming the grader")
    assert "| `reward.timeout_s` | `5.0` | Hard wall-clock limit per item" in config_markdown()
