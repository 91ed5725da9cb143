"""PNG plots of a run's metrics.jsonl: reward, entropy, response length, gate statistics, held-out accuracy."""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_maspo.train.observe.sinks import read_metrics

logger = logging.getLogger(__name__)

PANELS = (
    ("reward/mean", "mean reward (+1/-1)"),
    ("entropy/mean", "policy entropy (nats)"),
    ("response_length/mean", "response length (tokens)"),
    ("loss/pg", "policy-gradient loss"),
)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``plots/*.png`` for a run directory; returns the files written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plots (pip install 'megatron-maspo[logging]')")
        return []
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir / "metrics.jsonl")
    if not recs:
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    panels = [(k, t) for k, t in PANELS if any(r.get(k) is not None for r in recs)]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.2))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (k, title) in zip(axes, panels):
        xs = [r["step"] for r in recs if r.get(k) is not None]
        ys = [r[k] for r in recs if r.get(k) is not None]
        ax.plot(xs, ys, lw=1.5)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out_dir / "training.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    eval_keys = sorted({k for r in recs for k in r if k.startswith("eval/") and "/avg@" in k})
    if eval_keys:  # held-out accuracy over steps (eval.every)
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for k in eval_keys:
            pts = [(r["step"], r[k]) for r in recs if r.get(k) is not None]
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=k[5:], lw=1.2)
        ax.set_xlabel("rollout step")
        ax.set_ylabel("%")
        ax.set_title("held-out accuracy", fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out_dir / "eval.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    from megatron_maspo.train.observe.gate_plot import plot_gate

    if (p := plot_gate(recs, out_dir / "gate.png", plt)) is not None:
        written.append(p)
    return written
