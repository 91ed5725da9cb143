"""``plots/gate.png``: weights, other means and fractions in separate panels, legends outside the axes."""

from __future__ import annotations

import pytest

from megatron_maspo.train.observe.gate_plot import gate_series, plot_gate

RECS = [{"step": s, "gate/w_mean": 1.0 - 0.001 * s, "gate/w_mean_pos": 1.0, "maspo/sigma_mean": 1.1,
         "gate/attenuated_frac_neg": 0.02 * s, "clip/frac_pos": 0.0, "maspo/sigma_d3": 0.5,
         "reward/mean": 0.1} for s in (1, 2, 3)]


def test_series_are_grouped_by_scale():
    assert gate_series(RECS) == [
        (["gate/w_mean", "gate/w_mean_pos"], "gate weight (mean)"),
        (["maspo/sigma_mean"], "other means (MASPO sigma, ...)"),
        (["clip/frac_pos", "gate/attenuated_frac_neg"], "fraction of tokens"),
    ]  # per-bin maspo/sigma_d3 and non-gate keys are left out
    assert gate_series([{"step": 1, "reward/mean": 0.0}]) == []


def test_the_png_has_one_panel_per_group_with_the_legend_below(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    real_close = plt.close
    plt.close = lambda fig: figs.append(fig)  # keep the figure to inspect it, then close it for real
    try:
        path = plot_gate(RECS, tmp_path / "gate.png", plt)
    finally:
        plt.close = real_close
    assert path.is_file() and path.stat().st_size > 10_000
    (fig,) = figs
    axes = fig.get_axes()
    assert [a.get_title() for a in axes] == ["gate weight (mean)", "other means (MASPO sigma, ...)",
                                             "fraction of tokens"]
    fig.canvas.draw()
    for ax in axes:
        box, legend = ax.get_window_extent(), ax.get_legend().get_window_extent()
        assert legend.y1 < box.y0, "legend must sit below its axes, not over the lines"
    real_close(fig)
