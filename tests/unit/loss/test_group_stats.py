"""Group / mini-batch statistics (loss/group_stats.py) are functions of the whole group, not of a split."""

from __future__ import annotations

import torch

from megatron_maspo.loss import LossConfig, LossInputs, compute_advantages, compute_policy_loss
from megatron_maspo.loss.bapo import bapo_search_bounds
from megatron_maspo.loss.group_stats import (
    mini_batch_stats,
    prompt_group_stats,
    reps_prompt_lambdas,
)
from megatron_maspo.loss.params import BapoParams, QuatroParams

REPS = LossConfig(method="quatro", quatro=QuatroParams(dual_solver="reps_closed_form"))


def test_reps_lambda_of_whole_group_differs_from_its_halves():
    # 2 correct / 6 wrong, ±1 rewards: the example
    adv = compute_advantages(REPS, torch.tensor([[1.0, -1, 1, -1, -1, -1, -1, -1]], dtype=torch.float64))
    full = reps_prompt_lambdas(REPS, adv[0].tolist(), [0] * 8)[0]
    half_a = reps_prompt_lambdas(REPS, adv[0, :4].tolist(), [0] * 4)[0]
    half_b = reps_prompt_lambdas(REPS, adv[0, 4:].tolist(), [0] * 4)[0]
    assert abs(full - 7.03) < 0.05
    assert abs(half_a - full) > 0.1 and abs(half_b - full) > 1.0
    assert prompt_group_stats(REPS, adv) == [{"quatro/lambda": full}]
    assert prompt_group_stats(LossConfig(method="maspo"), adv) == [{}]


def test_loss_with_group_lambda_is_split_invariant():
    g = torch.Generator().manual_seed(0)
    t = 40
    lp, old = -torch.rand(t, generator=g, dtype=torch.float64), -torch.rand(t, generator=g, dtype=torch.float64)
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    seq = torch.arange(t) // 5
    pid = seq // 4
    lam = torch.tensor([0.3, 1.7], dtype=torch.float64)[pid]
    mask = torch.ones(t, dtype=torch.bool)

    def loss(sl):
        return compute_policy_loss(REPS, LossInputs(
            logprobs=lp[sl], old_logprobs=old[sl], advantages=adv[sl], mask=mask[sl],
            num_tokens_global=t, seq_ids=seq[sl], prompt_ids=pid[sl],
            batch_stats={"quatro/lambda": lam[sl]}))[0]

    whole = loss(slice(0, t))
    parts = loss(slice(0, 13)) + loss(slice(13, 27)) + loss(slice(27, t))
    torch.testing.assert_close(whole, parts)
    # without the group value, a split call re-solves λ on its own tokens and the loss changes
    plain = sum(compute_policy_loss(REPS, LossInputs(
        logprobs=lp[s], old_logprobs=old[s], advantages=adv[s], mask=mask[s], num_tokens_global=t,
        seq_ids=seq[s], prompt_ids=pid[s]))[0] for s in (slice(0, 13), slice(13, 27), slice(27, t)))
    assert not torch.allclose(whole, plain)


def test_mini_batch_stats_ignore_token_order():
    g = torch.Generator().manual_seed(1)
    t = 64
    old = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    lp = old + 0.4 * torch.randn(t, generator=g, dtype=torch.float64)
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    pid = torch.randint(0, 5, (t,), generator=g)
    perm = torch.randperm(t, generator=g)
    mask = torch.ones(t, dtype=torch.bool)
    tokens = LossInputs(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, prompt_ids=pid,
                        num_tokens_global=t)
    shuffled = LossInputs(logprobs=lp[perm], old_logprobs=old[perm], advantages=adv[perm], mask=mask,
                          prompt_ids=pid[perm], num_tokens_global=t)
    for cfg in (LossConfig(method="bapo", bapo=BapoParams(contribution="gradient_mass", target_share=0.6)),
                LossConfig(method="quatro", quatro=QuatroParams(dual_solver="dual_ascent"))):
        a = mini_batch_stats(cfg, tokens, range(5))
        b = mini_batch_stats(cfg, shuffled, range(5))
        assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
        for k in a[0]:
            torch.testing.assert_close(a[0][k], b[0][k])
        for k in a[1]:
            assert abs(a[1][k] - b[1][k]) < 1e-12
    bounds = mini_batch_stats(LossConfig(method="bapo"), tokens, range(5))[0]
    ref = bapo_search_bounds(torch.exp(lp - old), adv, mask, LossConfig(method="bapo"))
    assert (float(bounds["bapo/c_low"]), float(bounds["bapo/c_high"])) == ref[:2]
    none = mini_batch_stats(LossConfig(method="maspo"), tokens, range(5))
    assert none == ({}, {})
