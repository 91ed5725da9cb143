"""A deterministic byte-level tokenizer built in code (no downloads, no training).

Vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode map (ids 0-255, in byte order), then the
ChatML specials ``<|endoftext|>`` (256, pad), ``<|im_start|>`` (257), ``<|im_end|>`` (258, eos), then one
token per ``extra_texts`` entry. No merges: every digit, operator and letter is one token, which keeps
arithmetic tasks learnable by tiny models, and any UTF-8 string round-trips exactly (multi-byte characters
become several byte tokens). The result saves with ``save_pretrained`` into a model folder and loads back
with ``AutoTokenizer`` (and hence vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen2 uses it (without Qwen's default system message)."""


def _byte_symbols() -> list[str]:
    # GPT-2's reversible byte -> printable-unicode map; ByteLevel.alphabet() returns it unordered.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer(extra_texts: Sequence[str] | None = None) -> PreTrainedTokenizerFast:
    """Build the byte-level ChatML tokenizer described in the module docstring.

    Args:
        extra_texts: strings to add as whole added tokens after the specials (e.g. ``"<think>"``), in order.

    Returns:
        A fast tokenizer with ``len(tok) == 259 + len(extra_texts)``, ``eos_token="<|im_end|>"``,
        ``pad_token="<|endoftext|>"`` and a ChatML ``chat_template``.

    Raises:
        ValueError: an extra text is empty or duplicates a special token.
    """
    extras = list(extra_texts or ())
    for i, t in enumerate(extras):
        if not t or t in SPECIAL_TOKENS or extras.index(t) != i:
            raise ValueError(f"extra_texts[{i}]={t!r} is empty, a special token or a duplicate")
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if extras:
        tok.add_tokens(extras)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHATML_TEMPLATE
    assert fast.convert_tokens_to_ids("<|im_end|>") == 258, "special token ids moved"
    return fast


__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_byte_tokenizer"]
