"""GSPO and the rollout-correction modes against independent float64 references (issue 34).

The references are written per response with Python loops over plain float64 tensors: they do not call
the implementation (no `megatron_maspo.loss` helper), and they state the formulas of the GSPO paper
(arXiv 2507.18071 §4.1, §4.3) and of each correction mode (`loss/rollout_correction.py` docstring)
directly. Loss values and gradients must agree to 1e-7 on random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.loss import LossConfig, LossInputs, compute_policy_loss
from megatron_maspo.loss.params import GspoParams, RolloutCorrectionParams
from megatron_maspo.loss.registry import METHOD_REGISTRY, token_losses

F64 = torch.float64


def _batch(seed: int, n_seq: int = 7, spread: float = 0.02):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 10, (n_seq,), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(n_seq) * 3 + 5, lens)  # non-contiguous ids
    t = int(lens.sum())
    old = -torch.rand(t, generator=g, dtype=F64) * 3 - 0.01
    logp = old + spread * torch.randn(t, generator=g, dtype=F64)
    adv = torch.randn(n_seq, generator=g, dtype=F64)[torch.repeat_interleave(torch.arange(n_seq), lens)]
    rollout = old + 0.4 * torch.randn(t, generator=g, dtype=F64)
    mask = torch.rand(t, generator=g) > 0.1
    return logp, old, adv, rollout, mask, seq_ids


def _gspo_reference(logp, old, adv, mask, seq_ids, eps_low, eps_high):
    """J = (1/G) Σ_i min(s_i Â_i, clip(s_i, 1-ε_l, 1+ε_h) Â_i), s_i = exp(mean_t (logp - old)).

    Sequence-level objective (GSPO §4.1) with per-token advantages entering through GSPO-token
    (§4.3): each token contributes min(s_i Â_t, clip(s_i) Â_t) / |y_i| with ∇s_i,t = s_i ∇logp_t."""
    ids = sorted(set(seq_ids[mask].tolist()))
    total = torch.zeros((), dtype=F64)
    for sid in ids:
        sel = (seq_ids == sid) & mask
        n = int(sel.sum())
        lr = logp[sel] - old[sel]
        s_val = math.exp(float(lr.detach().sum()) / n)
        # GSPO-token: s_i,t = sg[s_i]·exp(logp_t - sg[logp_t])
        s_tok = s_val * torch.exp(logp[sel] - logp[sel].detach())
        a = adv[sel]
        clipped = torch.clamp(s_tok, 1 - eps_low, 1 + eps_high)
        total = total + torch.minimum(s_tok * a, clipped * a).sum() / n
    return -total / len(ids)


@pytest.mark.parametrize("spread", [2e-4, 0.02])
def test_gspo_matches_reference(spread):
    for seed in range(4):
        logp, old, adv, _, mask, seq_ids = _batch(seed, spread=spread)
        n_seq = len(set(seq_ids[mask].tolist()))
        for eps in ((3e-4, 4e-4), (0.01, 0.02)):
            cfg = LossConfig(method="gspo", gspo=GspoParams(eps_low=eps[0], eps_high=eps[1]))
            x = logp.clone().requires_grad_()
            loss, met = compute_policy_loss(cfg, LossInputs(
                logprobs=x, old_logprobs=old, advantages=adv, mask=mask,
                num_tokens_global=int(mask.sum()), num_seqs_global=n_seq, seq_ids=seq_ids))
            (g,) = torch.autograd.grad(loss, x)
            y = logp.clone().requires_grad_()
            ref = _gspo_reference(y, old, adv, mask, seq_ids, *eps)
            (g_ref,) = torch.autograd.grad(ref, y)
            assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-7
            torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-7)
            assert g.abs().sum() > 0
    # non-vacuous: at the paper's 3e-4 / 4e-4 some sequences clip and some do not
    logp, old, adv, _, mask, seq_ids = _batch(0, spread=1e-3)
    _, met = compute_policy_loss(LossConfig(method="gspo"), LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask,
        num_tokens_global=int(mask.sum()), num_seqs_global=7, seq_ids=seq_ids))
    clipped = float(met["clip/frac_pos"] + met["clip/frac_neg"])
    assert 0 < clipped < float(met["tokens/pos_frac"] + met["tokens/neg_frac"])


def test_gspo_token_gradient_equals_sequence_level_gspo():
    """With Â constant per response, differentiating GSPO's sequence objective through
    s_i = exp(mean_t log ρ_t) itself (§4.1/§4.2) gives the same gradient (§4.3)."""
    logp, old, adv, _, mask, seq_ids = _batch(3, spread=1e-3)
    n_seq = len(set(seq_ids[mask].tolist()))
    x = logp.clone().requires_grad_()
    loss, _ = compute_policy_loss(LossConfig(method="gspo"), LossInputs(
        logprobs=x, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=int(mask.sum()),
        num_seqs_global=n_seq, seq_ids=seq_ids))
    (g,) = torch.autograd.grad(loss, x)
    y = logp.clone().requires_grad_()
    ref = torch.zeros((), dtype=F64)
    for sid in sorted(set(seq_ids[mask].tolist())):
        sel = (seq_ids == sid) & mask
        s_i = torch.exp((y[sel] - old[sel]).mean())
        a = adv[sel][0]
        ref = ref - torch.minimum(s_i * a, torch.clamp(s_i, 1 - 3e-4, 1 + 4e-4) * a)
    (g_ref,) = torch.autograd.grad(ref / n_seq, y)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert (g_ref != 0).any() and (g_ref[mask] == 0).any()  # some responses clipped, some not


def test_gspo_needs_seq_ids_and_defaults():
    cfg = LossConfig(method="gspo")
    assert (cfg.gspo.eps_low, cfg.gspo.eps_high) == (3e-4, 4e-4)
    assert cfg.effective_aggregation == "seq-mean-token-mean"
    logp, old, adv, _, mask, _ = _batch(1)
    with pytest.raises(ValueError, match="seq_ids"):
        compute_policy_loss(cfg, LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=10,
            num_seqs_global=3))


def _factor_reference(mode, old, rollout, mask, seq_ids, lo, hi, cap):
    """c_t per token, per response, from the definitions (k = π_old / π_rollout)."""
    c = torch.zeros_like(old)
    dropped = torch.zeros_like(mask)
    for t in range(len(old)):
        k = math.exp(float(old[t] - rollout[t]))
        if mode == "tis":
            c[t] = min(k, cap)
        elif mode == "token_mask":
            c[t], dropped[t] = (1.0, False) if lo <= k <= hi else (0.0, True)
        elif mode == "icepop":
            c[t], dropped[t] = (k, False) if lo <= k <= hi else (0.0, True)
    if mode == "seq_mask":
        for sid in set(seq_ids.tolist()):
            sel = seq_ids == sid
            valid = sel & mask
            n = int(valid.sum())
            geo = math.exp(float((old[valid] - rollout[valid]).sum()) / n) if n else 1.0
            keep = lo <= geo <= hi
            c[sel] = 1.0 if keep else 0.0
            dropped[sel] = not keep
    return c, dropped


CASES = [("tis", {"cap": 1.5}), ("token_mask", {"lower": 0.8, "upper": 1.25}), ("token_mask", {}),
         ("icepop", {}), ("icepop", {"lower": 0.9, "upper": 1.1}), ("seq_mask", {"lower": 0.9, "upper": 1.1}),
         ("seq_mask", {})]


def _grpo_reference_tokens(logp, old, adv):
    """PPO-clip per token, -min(ρÂ, clip(ρ, 0.8, 1.2)Â), with verl's dual-clip 3 for Â < 0."""
    r = torch.exp(logp - old)
    ppo = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.2) * adv)
    return torch.where((adv < 0) & (r.detach() > 3.0), -3.0 * adv, ppo)


@pytest.mark.parametrize("mode,kw", CASES)
@pytest.mark.parametrize("method", ["grpo", "gspo"])
def test_rollout_correction_matches_reference(mode, kw, method):
    rc = RolloutCorrectionParams(mode=mode, **kw)
    lo, hi = rc.band()
    for seed in range(3):
        logp, old, adv, rollout, mask, seq_ids = _batch(seed, spread=0.3)
        n, s = int(mask.sum()), len(set(seq_ids[mask].tolist()))
        x = logp.clone().requires_grad_()
        loss, met = compute_policy_loss(LossConfig(method=method, rollout_correction=rc), LossInputs(
            logprobs=x, old_logprobs=old, advantages=adv, mask=mask, rollout_logprobs=rollout,
            num_tokens_global=n, num_seqs_global=s, seq_ids=seq_ids))
        (g,) = torch.autograd.grad(loss, x)
        c_ref, dropped_ref = _factor_reference(mode, old, rollout, mask, seq_ids, lo, hi, kw.get("cap"))
        y = logp.clone().requires_grad_()
        m = mask.to(F64)
        if method == "gspo":  # per response: (1/|y_i|) Σ_t c_t·ℓ_t, then the mean over responses
            ref = torch.zeros((), dtype=F64)
            for sid in sorted(set(seq_ids[mask].tolist())):
                sel = (seq_ids == sid) & mask
                s_val = math.exp(float((y[sel] - old[sel]).detach().sum()) / int(sel.sum()))
                s_tok = s_val * torch.exp(y[sel] - y[sel].detach())
                a = adv[sel]
                tok = -torch.minimum(s_tok * a, torch.clamp(s_tok, 1 - 3e-4, 1 + 4e-4) * a)
                ref = ref + (c_ref[sel] * tok).sum() / int(sel.sum())
            ref = ref / s
        else:
            ref = (_grpo_reference_tokens(y, old, adv) * c_ref * m).sum() / n
        (g_ref,) = torch.autograd.grad(ref, y)
        assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-7, (mode, method, seed)
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-7)
        want_frac = float((dropped_ref & mask).sum()) / n
        assert abs(float(met["rollout_corr/masked_frac"]) - want_frac) <= 1e-12
        if mode != "tis" and seed == 0 and (kw or mode != "seq_mask"):
            assert 0 < want_frac < 1, (mode, kw)  # the band bites on these inputs, not everywhere


@pytest.mark.parametrize("method", sorted(METHOD_REGISTRY))
def test_rollout_correction_composes_with_every_method(method):
    """The corrected loss is the uncorrected per-token loss times the same factor, for every method."""
    logp, old, adv, rollout, mask, seq_ids = _batch(2, spread=0.3)
    n = int(mask.sum())
    rc = RolloutCorrectionParams(mode="icepop", lower=0.8, upper=1.25)
    kw = dict(num_tokens_global=n, num_seqs_global=7, seq_ids=seq_ids, prompt_ids=seq_ids // 7,
              aggregation="token-mean")
    agg = kw.pop("aggregation")
    corr = LossConfig(method=method, aggregation=agg, rollout_correction=rc)
    x = logp.clone().requires_grad_()
    loss, _ = compute_policy_loss(corr, LossInputs(
        logprobs=x, old_logprobs=old, advantages=adv, mask=mask, rollout_logprobs=rollout, **kw))
    (g,) = torch.autograd.grad(loss, x)
    c, _ = _factor_reference("icepop", old, rollout, mask, seq_ids, 0.8, 1.25, None)
    y = logp.clone().requires_grad_()
    tok = token_losses(method, y, old, adv,
                       {"mask": mask, "seq_ids": seq_ids, "prompt_ids": seq_ids // 7})
    ref = (tok * c * mask.to(F64)).sum() / n
    (g_ref,) = torch.autograd.grad(ref, y)
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-10
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_rollout_correction_config():
    assert LossConfig(tis_cap=2.0).effective_rollout_correction == RolloutCorrectionParams(mode="tis", cap=2.0)
    assert LossConfig(tis_cap=2.0).rollout_correction.mode == "none"  # the alias is resolved, not stored
    LossConfig(tis_cap=2.0, rollout_correction=RolloutCorrectionParams(mode="tis", cap=2.0))  # consistent
    assert RolloutCorrectionParams(mode="icepop").band() == (0.5, 5.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=2.0, rollout_correction=RolloutCorrectionParams(mode="icepop"))
    with pytest.raises(ValueError, match="mode"):
        RolloutCorrectionParams(mode="mis")
    with pytest.raises(ValueError, match="cap"):
        RolloutCorrectionParams(mode="tis")
    with pytest.raises(ValueError, match="lower"):
        RolloutCorrectionParams(mode="token_mask", lower=2.0, upper=1.0)
    logp, old, adv, _, mask, seq_ids = _batch(0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        icepop = LossConfig(rollout_correction=RolloutCorrectionParams(mode="icepop"))
        compute_policy_loss(icepop, LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=10))
