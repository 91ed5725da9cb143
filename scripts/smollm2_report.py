"""Report of SmolLM2-135M-Instruct RL runs on CPU: held-out accuracy before/after and training curves.

Each run is a plain ``maspo train --recipe smollm2`` (the recipe evaluates on held-out problems at step 0
and at its last step); this script only reads their ``metrics.jsonl``::

    for m in maspo grpo; do for s in 1 2; do
      maspo train --recipe smollm2 --set loss.method=$m --set train.seed=$s \\
          --set checkpoint.run_dir=runs/smol/${m}_seed$s --set checkpoint.save_every=0
    done; done
    python scripts/smollm2_report.py runs/smol/*_seed* --out runs/smol --doc docs/smollm2-cpu.md

A run directory's name must end in ``<method>_seed<N>``. Writes ``<out>/table.md``, ``<out>/curves.png``
and, with ``--doc``, the same into the results block of that Markdown file (plot copied to ``figures/``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docblock import write_block  # noqa: E402

BEGIN, END = "<!-- smollm2-report:begin -->", "<!-- smollm2-report:end -->"
_NAME = re.compile(r"(?P<method>[a-z_]+)_seed(?P<seed>\d+)$")


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def summarize(run_dir: Path) -> dict:
    """One run's figures. Eval rows (``eval/average/avg@k``) give held-out accuracy at their step;
    training rows give the curves. Raises if the run has no eval before training or no training step."""
    m = _NAME.search(run_dir.name)
    if m is None:
        raise ValueError(f"{run_dir}: name must end in <method>_seed<N>")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/average/avg@") for k in r)]
    if not train or not evals or evals[0]["step"] != 0:
        raise ValueError(f"{run_dir}: needs an eval at step 0 and at least one training step")
    avg_key = next(k for k in evals[0] if k.startswith("eval/average/avg@"))
    k = avg_key.rsplit("@", 1)[1]
    last = evals[-1] if len(evals) > 1 else None
    clip = [r.get("clip/frac_pos", 0.0) + r.get("clip/frac_neg", 0.0) for r in train]
    return {
        "method": m["method"], "seed": int(m["seed"]), "k": int(k), "steps": len(train),
        "eval_steps": [e["step"] for e in evals],
        "avg_before": evals[0][avg_key], "avg_after": last[avg_key] if last else None,
        "pass_before": evals[0][f"eval/average/pass@{k}"],
        "pass_after": last[f"eval/average/pass@{k}"] if last else None,
        "reward": [r["reward/mean"] for r in train],
        "accuracy": [r["reward/accuracy"] for r in train],
        "entropy": [r["entropy/mean"] for r in train],
        "length": [r["response_length/mean"] for r in train],
        "mismatch_kl": _mean([r["mismatch/kl_k3"] for r in train if "mismatch/kl_k3" in r]),
        "mismatch_max": max((r["mismatch/logprob_abs_diff_max"] for r in train
                             if "mismatch/logprob_abs_diff_max" in r), default=float("nan")),
        "gate_w_lt_0p9": _mean([r.get("gate/w_lt_0.9_frac", 0.0) for r in train]),
        "clip_frac": _mean(clip),
        "step_s": _mean([r["time/step"] for r in train]),
        "minutes": (sum(r["time/step"] for r in train) + sum(e.get("eval/seconds", 0.0) for e in evals)) / 60,
    }


def _pp(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def table(runs: list[dict], window: int = 3) -> str:
    """Per-run rows and a per-method mean; accuracy is exact-match over k samples of each held-out problem."""
    k = runs[0]["k"]
    head = (f"| method | seed | held-out avg@{k} before → after | pass@{k} before → after | "
            f"train reward first {window} → last {window} | entropy first → last | mean length first → last | "
            "gate w<0.9 | clip frac | trainer/engine KL (k3) | max abs logprob diff | s / step | min (steps + evals) |")
    lines = [head, "|" + "---|" * 13]
    for r in sorted(runs, key=lambda r: (r["method"], r["seed"])):
        rw, n = r["reward"], min(window, len(r["reward"]))
        lines.append(
            f"| {r['method']} | {r['seed']} | {_pp(r['avg_before'])} → {_pp(r['avg_after'])} | "
            f"{_pp(r['pass_before'])} → {_pp(r['pass_after'])} | {_mean(rw[:n]):+.3f} → {_mean(rw[-n:]):+.3f} | "
            f"{r['entropy'][0]:.3f} → {r['entropy'][-1]:.3f} | {r['length'][0]:.1f} → {r['length'][-1]:.1f} | "
            f"{100 * r['gate_w_lt_0p9']:.2f}% | {100 * r['clip_frac']:.2f}% | {r['mismatch_kl']:.1e} | "
            f"{r['mismatch_max']:.1e} | {r['step_s']:.0f} | {r['minutes']:.1f} |")
    lines += ["", f"| method | seeds | held-out avg@{k} before → after (mean) | change (per seed) |", "|---|---|---|---|"]
    for method in sorted({r["method"] for r in runs}):
        rs = [r for r in runs if r["method"] == method and r["avg_after"] is not None]
        if not rs:
            continue
        deltas = ", ".join(f"{r['avg_after'] - r['avg_before']:+.3f}" for r in sorted(rs, key=lambda r: r["seed"]))
        lines.append(f"| {method} | {len(rs)} | {_mean([r['avg_before'] for r in rs]):.3f} → "
                     f"{_mean([r['avg_after'] for r in rs]):.3f} | {deltas} |")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path) -> Path | None:
    """Reward, accuracy and entropy per step, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(11, 3))
    for ax, key, label in zip(axes, ("reward", "accuracy", "entropy"), ("mean reward", "train accuracy", "entropy")):
        for r in sorted(runs, key=lambda r: (r["method"], r["seed"])):
            ax.plot(range(1, r["steps"] + 1), r[key], label=f"{r['method']} s{r['seed']}",
                    linestyle="-" if r["method"] == "maspo" else "--")
        ax.set_xlabel("RL step", fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_doc(doc: Path, text_table: str, fig: Path | None, command: str) -> None:
    """Replace the results block of ``doc`` (appended if missing) with the table and the plot."""
    write_block(doc, BEGIN, END, f"Produced by `{command}`.\n\n{text_table}", [fig] if fig else [], "smollm2_",
                "SmolLM2 on CPU")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories named <method>_seed<N>")
    ap.add_argument("--out", default=None, help="where table.md and curves.png go (default: the first run's parent)")
    ap.add_argument("--doc", default=None, help="Markdown file whose results block to rewrite")
    args = ap.parse_args(argv)
    runs = [summarize(Path(r)) for r in args.runs]
    out = Path(args.out) if args.out else Path(args.runs[0]).parent
    out.mkdir(parents=True, exist_ok=True)
    text_table = table(runs)
    (out / "table.md").write_text(text_table + "\n")
    print(text_table)
    fig = plot(runs, out)
    if args.doc:
        write_doc(Path(args.doc), text_table, fig, "python scripts/smollm2_report.py " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
