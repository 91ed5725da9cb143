"""Synthetic arithmetic determinism, byte tokenizer round-trip and chat template, prompt tokenization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_maspo.data import DataConfig, build_prompt_dataset
from megatron_maspo.data.synthetic import arithmetic_examples
from megatron_maspo.data.tokenizer import build_byte_tokenizer


def test_synthetic_deterministic_and_correct() -> None:
    a = arithmetic_examples(num_examples=50, seed=3)
    b = arithmetic_examples(num_examples=50, seed=3)
    c = arithmetic_examples(num_examples=50, seed=4)
    assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    for e in a:  # single-digit a+b
        x, y = e.prompt.removeprefix("Compute ").split(".")[0].split("+")
        assert 0 <= int(x) <= 9 and 0 <= int(y) <= 9 and int(e.answer) == int(x) + int(y)
    hard = arithmetic_examples(
        num_examples=20, max_operand=99, num_operands=3, ops=("-", "*"), seed=0
    )
    for e in hard:
        expr = e.prompt.removeprefix("Compute ").split(". ")[0]
        assert len([ch for ch in expr if ch in "-*"]) >= 2 and str(eval(expr)) == e.answer


def test_byte_tokenizer_round_trip_and_save(tmp_path: Path) -> None:
    tok = build_byte_tokenizer()
    assert len(tok) == 259 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 258 and tok.pad_token_id == 256
    assert tok.encode("3+4=7", add_special_tokens=False) == [ord(c) for c in "3+4=7"]
    rng = random.Random(0)
    samples = [
        "",
        " leading space",
        "tabs\tand\nnewlines\r\n",
        "héllo 你好 🙂 \u200b",
        "\\boxed{\\frac12}",
    ]
    samples += [
        "".join(chr(rng.randint(1, 0x10FFFF)) for _ in range(20))
        .encode("utf-8", "ignore")
        .decode("utf-8", "ignore")
        for _ in range(50)
    ]
    for s in samples:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("ab 你", add_special_tokens=False) == tok.encode(
        "ab 你", add_special_tokens=False
    )
    assert again.eos_token_id == 258 and again.chat_template == tok.chat_template
    assert len(build_byte_tokenizer(["<think>", "</think>"])) == 261
    with pytest.raises(ValueError, match="extra_texts"):
        build_byte_tokenizer(["<|im_end|>"])


def test_chat_template_and_prompt_dataset() -> None:
    tok = build_byte_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    cfg = DataConfig(num_examples=8, system_prompt="Be brief.", max_prompt_tokens=90)
    exs, skips = build_prompt_dataset(cfg, tok)
    assert len(exs) + skips.total == 8
    ids = exs[0].prompt_ids
    assert ids[0] == 257 and tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    # Over-long prompts are skipped and counted, not truncated.
    lengths = [
        len(e.prompt_ids)
        for e in build_prompt_dataset(DataConfig(num_examples=32, max_operand=99), tok)[0]
    ]
    cap = max(lengths) - 1  # drops the prompts with the longest operands only
    exs, skips = build_prompt_dataset(
        DataConfig(num_examples=32, max_operand=99, max_prompt_tokens=cap), tok
    )
    assert skips.counts["too_long"] == sum(n > cap for n in lengths) > 0
    assert len(exs) == sum(n <= cap for n in lengths) and all(len(e.prompt_ids) <= cap for e in exs)
    with pytest.raises(ValueError, match="no usable row"):
        build_prompt_dataset(DataConfig(num_examples=4, max_prompt_tokens=5), tok)
