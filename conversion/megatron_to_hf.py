"""Megatron distributed checkpoint (any layout) -> HF folder loadable by transformers and vLLM.

    python conversion/megatron_to_hf.py --ckpt DIR --out DIR [--dtype bfloat16] [--verify]
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from megatron_maspo.cli.convert import main

    raise SystemExit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
