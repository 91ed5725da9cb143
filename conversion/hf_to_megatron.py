"""HF folder -> Megatron distributed checkpoint.

    python conversion/hf_to_megatron.py --hf DIR --out DIR [--tp 2 --pp 2 --ep 1] [--verify]
    torchrun --nproc-per-node 4 conversion/hf_to_megatron.py --hf DIR --out DIR --tp 2 --pp 2
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from megatron_maspo.cli.convert import main

    raise SystemExit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
