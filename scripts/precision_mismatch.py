"""Trainer/engine log-prob mismatch of the tiny recipe in fp32, bf16 and fp16, on CPU, in one run.

Runs ``maspo train`` (tiny recipe, built-in engine) once per precision, each in its own process, and
reads the ``mismatch/*`` metrics the loop logs for every rollout: the trainer's recomputed log π_old
against the engine's log-probs of the same sampled tokens (`rollout/diagnostics.py`). Writes
``<out>/table.md`` and ``<out>/results.json``; the table lands in docs/precision.md.

    python scripts/precision_mismatch.py --out runs/precision --steps 2 --sft-steps 0

``--sft-steps 0`` measures at the recipe's initial weights (the same fp32 draw, cast per precision);
a warm start moves the figures little but costs minutes per precision on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = {"fp32": [], "bf16": ["model.bf16=true"], "fp16": ["model.fp16=true"]}
KEYS = ("mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/prob_ratio_err_mean",
        "mismatch/kl_k3")


def run_one(name: str, out: Path, steps: int, sft_steps: int, extra: list[str]) -> tuple[Path, float]:
    run_dir = out / name
    sets = [*PRECISIONS[name], f"train.steps={steps}", f"train.sft_steps={sft_steps}",
            f"checkpoint.run_dir={run_dir}", "checkpoint.save_every=0", "logging.progress=false",
            "logging.tensorboard=false", *extra]
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"]
    for s in sets:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return run_dir, time.perf_counter() - t0


def summarise(run_dir: Path) -> dict[str, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = {k: statistics.mean(r[k] for r in recs if k in r) for k in KEYS}
    out["train_s_per_step"] = statistics.mean(r["time/train"] for r in recs)
    out["generate_s_per_step"] = statistics.mean(r["time/generate"] for r in recs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/precision")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra --set for every run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.precisions:
        run_dir, wall = run_one(name, out, args.steps, args.sft_steps, args.extra)
        results[name] = {**summarise(run_dir), "wall_s": wall}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| precision | mean abs Δlog p | max abs Δlog p | mean abs(π_old/π_rollout - 1) | KL k3 "
             "(rollout ‖ trainer) | train s/step | generate s/step |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r[KEYS[0]]:.2e} | {r[KEYS[1]]:.2e} | {r[KEYS[2]]:.2e} | {r[KEYS[3]]:.2e} | "
                     f"{r['train_s_per_step']:.1f} | {r['generate_s_per_step']:.1f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
