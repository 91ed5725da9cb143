"""``scripts/compare_losses.py`` states the loss settings each run uses, and runs dual-clip both ways."""

from __future__ import annotations


def test_every_ppo_clip_baseline_runs_with_and_without_dual_clip(compare):
    for m in ("grpo", "clip_higher", "dac", "bapo"):
        assert f"{m}_nodual" in compare.METHODS
        on, off = compare.method_settings(m, []), compare.method_settings(f"{m}_nodual", [])
        assert "'dual_clip_c': 3.0" in on and "'dual_clip_c': None" in off, (on, off)


def test_settings_name_the_resolved_group_and_aggregation(compare):
    s = compare.method_settings("gspo", [])
    assert "loss.method=gspo" in s and "'eps_low': 0.0003" in s and "seq-mean-token-mean" in s
    assert "'dual_solver': 'reps_closed_form'" in compare.method_settings("quatro", [])
    assert "'eps_low': None" in compare.method_settings("cispo", [])
    assert "'alpha': 0.1" in compare.method_settings("adv_reweight", [])  # a shared modifier is shown
    assert "'alpha': 0.5" in compare.method_settings("maspo", ["loss.maspo.alpha=0.5"])  # and --set
