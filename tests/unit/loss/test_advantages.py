"""Advantage estimators against loss-formulas.md §1 reference values, plus the per-token modifiers."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.loss import LossConfig, compute_advantages
from megatron_maspo.loss.advantages import entropy_advantage, reweight_advantage

F64 = torch.float64


def _group(g: int, correct: int) -> torch.Tensor:
    return torch.tensor([[1.0] * correct + [-1.0] * (g - correct)], dtype=F64)


@pytest.mark.parametrize("g,c,a_pos,a_neg,p_pos,p_neg", [
    (8, 1, 2.4749, -0.3536, 2.6458, -0.3780), (8, 7, 0.3536, -2.4749, 0.3780, -2.6458),
    (16, 1, 3.7500, -0.2500, 3.8730, -0.2582), (16, 8, 0.9682, -0.9682, 1.0, -1.0),
    (16, 15, 0.2500, -3.7500, 0.2582, -3.8730),
])
def test_grpo_reference_table(g, c, a_pos, a_neg, p_pos, p_neg):
    adv = compute_advantages(LossConfig(), _group(g, c))[0]
    assert adv[0].item() == pytest.approx(a_pos, abs=6e-5)
    assert adv[-1].item() == pytest.approx(a_neg, abs=6e-5)
    pop = compute_advantages(LossConfig(std_unbiased=False), _group(g, c))[0]
    assert pop[0].item() == pytest.approx(p_pos, abs=6e-5)
    assert pop[-1].item() == pytest.approx(p_neg, abs=6e-5)
    # Affine invariance: 1/0 rewards give the same standardised advantages.
    # (up to ε_A = 1e-6 against a std that halves)
    torch.testing.assert_close(compute_advantages(LossConfig(), (_group(g, c) + 1) / 2)[0], adv,
                               rtol=1e-5, atol=0)


def test_degenerate_groups_and_other_estimators():
    r = torch.cat([_group(8, 8), _group(8, 0), _group(8, 3)])
    for est in ("grpo", "drgrpo", "rloo"):
        adv = compute_advantages(LossConfig(advantage=est), r)
        assert torch.all(adv[:2] == 0), est
        assert adv[2].sum().abs() < 1e-12
    dr = compute_advantages(LossConfig(advantage="drgrpo"), r)[2]
    torch.testing.assert_close(dr, r[2] - r[2].mean())
    assert dr.max().item() == pytest.approx(2 - 2 * 3 / 8)
    rloo = compute_advantages(LossConfig(advantage="rloo"), r)[2]
    i = 0
    assert rloo[i].item() == pytest.approx(r[2, i].item() - (r[2].sum() - r[2, i]).item() / 7)
    one = compute_advantages(LossConfig(), torch.tensor([[1.0], [-1.0]], dtype=F64))
    torch.testing.assert_close(one, torch.tensor([[1.0], [-1.0]], dtype=F64), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages(LossConfig(advantage="rloo"), torch.ones(2, 1, dtype=F64))
    with pytest.raises(ValueError, match="rewards_P_G"):
        compute_advantages(LossConfig(), torch.ones(8, dtype=F64))
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(LossConfig(), torch.tensor([[1.0, float("nan")]], dtype=F64))


def test_entropy_advantage_and_reweighting():
    adv = torch.tensor([2.0, -2.0, 0.0, 1.0], dtype=F64)
    ent = torch.tensor([1.0, 1.0, 5.0, 10.0], dtype=F64, requires_grad=True)
    out = entropy_advantage(adv, ent, coef=0.4, kappa=2.0)
    torch.testing.assert_close(out, torch.tensor([2.4, -1.6, 0.0, 1.5], dtype=F64))
    assert not out.requires_grad  # entropy enters detached
    p_old = torch.tensor([0.5, 1.0, 0.1, 0.0], dtype=F64)
    rw = reweight_advantage(adv, p_old.log(), 0.1)
    torch.testing.assert_close(rw, adv * (0.1 * p_old + 0.9))
