"""Skip messages name rows one way per file: jsonl line numbers, from the reader through tokenizing."""

from __future__ import annotations

import json
import logging

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.dataset import build_prompt_dataset
from megatron_maspo.data.tokenizer import build_byte_tokenizer


def test_jsonl_skips_name_file_lines_even_after_tokenizing(tmp_path, caplog):
    f = tmp_path / "bad.jsonl"
    lines = [json.dumps({"question": "1+1=", "answer": "2"}),  # line 1: kept
             "{broken",  # line 2: bad_json
             json.dumps({"question": "q"}),  # line 3: no_answer
             json.dumps({"question": "x" * 500, "answer": "1"}),  # line 4: too_long after templating
             json.dumps({"question": "2+2=", "answer": "4"})]  # line 5: kept
    f.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(source=str(f), max_prompt_tokens=128, apply_chat_template=False)
    with caplog.at_level(logging.WARNING):
        examples, skips = build_prompt_dataset(cfg, build_byte_tokenizer())
    assert [e.origin for e in examples] == [f"{f}:1", f"{f}:5"]
    where = {r.args[0]: r.args[1] for r in caplog.records if r.getMessage().startswith("skipping row")}
    assert where == {"bad_json": f"{f}:2", "no_answer": f"{f}:3", "too_long": f"{f}:4"}, where
