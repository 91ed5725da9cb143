"""``plots/gate.png``: gate weights and token fractions in their own panels, legends outside the axes.

One axis for everything put ``gate/w_mean`` (~1.0) on top of seven fractions near 0 that no one could
tell apart; here the weights (means, around 1) and the fractions (0..1, usually small) each get a panel
scaled to their own data, and each legend sits under its panel.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_PREFIXES = ("maspo/", "sapo/", "clip/", "gate/")
_MAX_SERIES = 8


def gate_series(recs: list[dict]) -> list[tuple[list[str], str]]:
    """``[(keys, panel title)]`` of the gate statistics present in the records (at most 8 keys a panel).

    Gate weights (``gate/*mean*``, around 1), other means (MASPO's ``sigma_mean``, around 1 to 4) and
    fractions (``*frac*``, 0..1, usually small) each get a panel. Per-bin series (``maspo/*_d0`` ...) are
    left to TensorBoard: ten more lines would bury the rest.
    """
    keys = {k for r in recs for k in r if k.startswith(_PREFIXES) and r.get(k) is not None}
    keys = {k for k in keys if not re.search(r"_d\d+$", k)}
    fracs = sorted(k for k in keys if "frac" in k)
    means = sorted(k for k in keys if "mean" in k and "frac" not in k)
    groups = (([k for k in means if k.startswith("gate/")], "gate weight (mean)"),
              ([k for k in means if not k.startswith("gate/")], "other means (MASPO sigma, ...)"),
              (fracs, "fraction of tokens"))
    return [(ks[:_MAX_SERIES], title) for ks, title in groups if ks]


def plot_gate(recs: list[dict], path: Path, plt: Any) -> Path | None:
    """Write the gate figure to ``path``; None when the records have no gate statistics."""
    from matplotlib.ticker import MaxNLocator

    panels = gate_series(recs)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.4), squeeze=False)
    for ax, (keys, title) in zip(axes[0], panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in recs if r.get(k) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=k, lw=1.3, marker="o", ms=2.5)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
