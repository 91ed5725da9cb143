"""A custom dataset: your own problems, either as a jsonl file or as a Python function.

A jsonl file needs no code: one JSON object per line with a question and an answer field, e.g.
``{"question": "What is 12 - 5?", "answer": "7"}`` (also accepted: ``problem``/``prompt`` and
``final_answer``/``ground_truth``, or DAPO-Math rows), then

    maspo train --set data.source=my_problems.jsonl

A function is named as ``module:function``; it receives the ``DataConfig`` (``num_examples``, ``seed``,
...) and returns rows in the same schemas. Rows without an answer or with an empty question are skipped
and counted, as in a file:

    cd examples
    PYTHONPATH=. maspo train --set data.source=custom_dataset:subtraction_rows --set checkpoint.run_dir=runs/sub

(the module's folder goes on ``PYTHONPATH``: the working directory is not searched implicitly).

Running this file writes the function's rows as jsonl, the file route for the same data:

    python examples/custom_dataset.py my_problems.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any


def subtraction_rows(cfg: Any) -> list[dict[str, str]]:
    """``cfg.num_examples`` single-digit subtraction problems with non-negative results, seeded by
    ``cfg.seed`` (same seed, same rows)."""
    rng = random.Random(cfg.seed)
    rows = []
    for _ in range(cfg.num_examples):
        a, b = sorted((rng.randint(0, 9), rng.randint(0, 9)), reverse=True)
        rows.append({"question": f"{a}-{b}=", "answer": str(a - b)})
    return rows


if __name__ == "__main__":
    from types import SimpleNamespace

    out = sys.argv[1] if len(sys.argv) > 1 else "my_problems.jsonl"
    with open(out, "w") as f:
        for row in subtraction_rows(SimpleNamespace(num_examples=200, seed=0)):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {out}")
