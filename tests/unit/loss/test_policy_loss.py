"""compute_policy_loss: pinned metric keys, regularisers, aggregation, bad inputs, BAPO, QUATRO."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.loss import (
    LossConfig,
    LossInputs,
    compute_policy_loss,
    megatron_loss_tuple,
    token_losses,
)
from megatron_maspo.loss.bapo import bapo_search_bounds
from megatron_maspo.loss.metrics import finalize_metrics, reduce_metrics
from megatron_maspo.loss.params import (
    AdvReweightParams,
    BapoParams,
    ClipParams,
    EntropyAdvParams,
    MaspoParams,
    QuatroParams,
)
from megatron_maspo.loss.quatro import reps_lambda

F64 = torch.float64
GATE_KEYS = {
    "loss/pg", "loss/total", "loss/nonfinite_tokens", "policy/approx_kl", "ratio/mean", "ratio/min",
    "ratio/max", "tokens/pos_frac", "tokens/neg_frac", "clip/frac_pos", "clip/frac_neg",
    "gate/attenuated_frac_pos", "gate/attenuated_frac_neg", "gate/w_mean", "gate/w_pos", "gate/w_neg",
    "gate/w_lt_0.5_frac_pos",
    "gate/w_lt_0.5_frac_neg", "gate/w_lt_0.9_frac", "gate/w_ratio_mean", "gate/w_ratio_max",
}
MASPO_KEYS = {"maspo/sigma_mean", "maspo/sigma_cap_frac", "maspo/long_tail_frac",
              "maspo/dual_clip_c3_would_fire_frac", "maspo/dual_clip_c10_would_fire_frac",
              *(f"maspo/sigma_d{k}" for k in range(10)), *(f"maspo/p_old_frac_d{k}" for k in range(10))}


def _batch(n_seq: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 9, (n_seq,), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(n_seq), lens)
    t = int(lens.sum())
    old = -torch.rand(t, generator=g, dtype=F64) * 5 - 0.01
    logp = (old + 0.8 * torch.randn(t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(n_seq, generator=g, dtype=F64)[seq_ids]
    mask = torch.rand(t, generator=g) > 0.15
    return logp, old, adv, mask, seq_ids


def test_pinned_metric_keys():
    logp, old, adv, mask, seq = _batch()
    ent = torch.rand_like(old)
    kw = dict(num_tokens_global=int(mask.sum()), entropy=ent, ref_logprobs=old - 0.1,
              rollout_logprobs=old + 0.05)
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    _, met = compute_policy_loss(cfg, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, **kw))
    extra = {"loss/kl", "loss/entropy", "policy/entropy_mean", "tis/weight_mean", "tis/truncated_frac",
             "rollout_corr/masked_frac", "rollout_corr/weight_mean"}
    assert set(met) == GATE_KEYS | MASPO_KEYS | extra
    assert all(not v.requires_grad and v.dim() == 0 for v in met.values())
    per_method = {"grpo": set(), "dac": {"dac/low_mean", "dac/high_mean"},
                  "bapo": {"bapo/c_low", "bapo/c_high", "bapo/pos_share"},
                  "quatro": {"quatro/lambda_mean", "quatro/divergence_mean"}}
    for method, keys in per_method.items():
        _, met = compute_policy_loss(LossConfig(method=method), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask,
            num_tokens_global=int(mask.sum()), seq_ids=seq, prompt_ids=seq // 2))
        assert set(met) == GATE_KEYS | keys, method
    fin = finalize_metrics(reduce_metrics(compute_policy_loss(LossConfig(), LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask,
        num_tokens_global=int(mask.sum())))[1]))
    assert "maspo/sigma_mean_d9" in fin and "gate/w_mean_neg" in fin
    w_neg = fin["gate/w_mean_neg"].item()
    assert 0.5 < w_neg <= 1.0  # MASPO never attenuates a negative token by more than ~half (§13.4)


def test_metrics_are_additive_over_splits():
    logp, old, adv, mask, seq = _batch(8, seed=1)
    n = int(mask.sum())
    cut = int((seq < 4).sum())
    _, full = compute_policy_loss(LossConfig(), LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    parts = [compute_policy_loss(LossConfig(), LossInputs(
                 logprobs=logp[s], old_logprobs=old[s], advantages=adv[s], mask=mask[s],
                 num_tokens_global=n))[1]
             for s in (slice(0, cut), slice(cut, None))]
    for k, v in full.items():
        if k.endswith("min"):
            got = torch.minimum(parts[0][k], parts[1][k])
        elif k.endswith("max"):
            got = torch.maximum(parts[0][k], parts[1][k])
        else:
            got = parts[0][k] + parts[1][k]
        torch.testing.assert_close(got, v, msg=k)
    r = (logp.detach() - old).exp()[mask]
    assert full["ratio/mean"].item() == pytest.approx(r.mean().item())
    assert full["ratio/max"].item() == pytest.approx(r.max().item())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_formulas_and_megatron_tuple(mode):
    logp, old, adv, mask, seq = _batch(seed=2)
    cfg = LossConfig(method="grpo", aggregation=mode, norm_constant=16.0)
    loss, _ = compute_policy_loss(cfg, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask,
        num_tokens_global=int(mask.sum()), num_seqs_global=6, seq_ids=seq))
    ell = token_losses("grpo", logp, old, adv) * mask
    if mode == "token-mean":
        want = ell.sum() / mask.sum()
    elif mode == "seq-mean-token-mean":
        want = sum(ell[seq == i].sum() / mask[seq == i].sum() for i in range(6)) / 6
    elif mode == "seq-mean-token-sum":
        want = ell.sum() / 6
    else:
        want = ell.sum() / 16.0
    torch.testing.assert_close(loss, want)
    units = int(mask.sum()) if mode in ("token-mean", "seq-mean-token-sum-norm") else 6
    num, cnt, _ = megatron_loss_tuple(loss, num_local_units=units, num_global_units=units)
    torch.testing.assert_close(num / cnt, want)  # what finalize_model_grads computes with one rank


def test_regularisers_kl_entropy_tis():
    logp, old, adv, mask, _ = _batch(seed=3)
    n = int(mask.sum())
    ref = old - 0.3 * torch.rand_like(old)
    ent = torch.rand_like(old, requires_grad=True)
    roll = old + 0.4 * torch.randn_like(old)
    cfg = LossConfig(method="grpo", kl_coef=0.2, kl_type="k3", entropy_coef=0.05, tis_cap=1.5)
    loss, met = compute_policy_loss(cfg, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n,
        entropy=ent, ref_logprobs=ref, rollout_logprobs=roll))
    g_lp, g_ent = torch.autograd.grad(loss, (logp, ent))
    r = (logp.detach() - old).exp()
    w = torch.where(adv > 0, r <= 1.2, r >= 0.8).to(F64)
    tis = (old - roll).exp().clamp(max=1.5)
    kl_grad = 1 - (ref - logp.detach()).exp()  # ∇D_k3 = (1 - π_ref/π_θ)∇log π
    torch.testing.assert_close(g_lp, (-tis * w * r * adv + 0.2 * kl_grad) * mask / n)
    torch.testing.assert_close(g_ent, -0.05 * mask.to(F64) / n)
    torch.testing.assert_close(met["loss/total"], met["loss/pg"] + 0.2 * met["loss/kl"] - 0.05 * met["loss/entropy"])
    for kind, fn in (("k1", lambda d: d), ("k2", lambda d: 0.5 * d**2)):
        l2, _ = compute_policy_loss(LossConfig(method="grpo", kl_coef=1.0, kl_type=kind), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=torch.zeros_like(adv), mask=mask,
            num_tokens_global=n, ref_logprobs=ref))
        torch.testing.assert_close(l2, (fn(logp - ref) * mask).sum() / n)


def test_advantage_modifiers_compose_with_methods():
    logp, old, adv, mask, _ = _batch(seed=4)
    n = int(mask.sum())
    ent = torch.rand_like(old)
    cfg = LossConfig(method="maspo", entropy_adv=EntropyAdvParams(coef=0.4), adv_reweight=AdvReweightParams(alpha=0.1))
    loss, _ = compute_policy_loss(cfg, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n,
        entropy=ent))
    a2 = (adv + torch.minimum(0.4 * ent, adv.abs() / 2)) * (0.1 * old.exp() + 0.9)
    torch.testing.assert_close(loss, (token_losses("maspo", logp, old, a2) * mask).sum() / n)


def test_bad_inputs():
    logp, old, adv, mask, _ = _batch()
    n = int(mask.sum())
    with pytest.raises(ValueError, match="old_logprobs has"):
        compute_policy_loss(LossConfig(), LossInputs(
            logprobs=logp, old_logprobs=old[:-1], advantages=adv, mask=mask, num_tokens_global=n))
    with pytest.raises(ValueError, match="flat"):
        compute_policy_loss(LossConfig(), LossInputs(
            logprobs=logp[None], old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    bad = old.clone()
    bad[int(mask.nonzero()[0])] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs has 1 non-finite"):
        compute_policy_loss(LossConfig(), LossInputs(
            logprobs=logp, old_logprobs=bad, advantages=adv, mask=mask, num_tokens_global=n))
    with pytest.raises(TypeError, match="advantages must be a floating"):
        compute_policy_loss(LossConfig(), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv.long(), mask=mask, num_tokens_global=n))
    with pytest.raises(TypeError, match="seq_ids must be an integer"):
        compute_policy_loss(LossConfig(), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n,
            seq_ids=adv))
    with pytest.raises(ValueError, match="unknown method"):
        token_losses("ppo2", logp, old, adv)
    with pytest.raises(ValueError, match="sigma_bse"):
        token_losses("maspo", logp, old, adv, {"sigma_bse": 1.0})
    with pytest.raises(ValueError, match="non-finite"):
        token_losses("maspo", logp, bad, adv)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(LossConfig(kl_coef=0.1), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    with pytest.raises(ValueError, match="num_seqs_global"):
        compute_policy_loss(LossConfig(aggregation="seq-mean-token-sum"), LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    for field, value in (("method", "x"), ("kl_type", "k4"), ("nonfinite", "ignore"), ("aggregation", "mean"),
                         ("aggregation", "seq-mean-token-sum-norm"), ("kl_coef", -1.0)):
        with pytest.raises(ValueError, match=field):
            LossConfig(**{field: value})
    for cls, field, value in ((ClipParams, "eps_low", -0.1), (ClipParams, "dual_clip_c", 0.5),
                              (MaspoParams, "sigma_base", 0.0), (MaspoParams, "alpha", -1.0),
                              (MaspoParams, "safety_cap", 0.5), (BapoParams, "low_range", (0.9, 0.6)),
                              (BapoParams, "scope", "batch"), (QuatroParams, "dual_solver", "newton")):
        with pytest.raises(ValueError, match=f"{cls.__name__}.{field}"):
            cls(**{field: value})


def test_nonfinite_mask_mode():
    logp, old, adv, mask, _ = _batch(seed=5)
    n = int(mask.sum())
    i = int(mask.nonzero()[1])
    lp_bad = logp.detach().clone()
    lp_bad[i] = float("nan")
    lp_bad.requires_grad_()
    cfg = LossConfig(nonfinite="mask")
    loss, met = compute_policy_loss(cfg, LossInputs(
        logprobs=lp_bad, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    (g,) = torch.autograd.grad(loss, lp_bad)
    assert torch.isfinite(g).all() and g[i] == 0
    m2 = mask.clone()
    m2[i] = False
    want, _ = compute_policy_loss(LossConfig(), LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=m2, num_tokens_global=n))
    torch.testing.assert_close(loss, want)
    assert met["loss/nonfinite_tokens"].item() == 1.0


def _bapo_reference(r, a, cfg):
    """Literal transcription of BAPO Alg. 1 (paper order), one evaluation per step."""
    b = cfg.bapo
    lo, hi = b.low_range[0], b.high_range[0]

    def share(lo, hi):
        p = (a.clamp(min=0) * torch.minimum(r, torch.tensor(hi, dtype=F64))).sum()
        nn = ((-a).clamp(min=0) * torch.maximum(r, torch.tensor(lo, dtype=F64))).sum()
        return float(p / (p + nn))

    while share(lo, hi) < b.target_share and lo + b.step_low <= b.low_range[1] + 1e-9:
        if hi + b.step_high <= b.high_range[1] + 1e-9:
            hi += b.step_high
        else:
            lo += b.step_low
    return lo, hi


def _bapo(**kw) -> LossConfig:
    return LossConfig(method="bapo", bapo=BapoParams(**kw))


def test_bapo_bound_search():
    g = torch.Generator().manual_seed(0)
    r = torch.exp(0.8 * torch.randn(400, generator=g, dtype=F64))
    mask = torch.ones(400, dtype=torch.bool)
    a = torch.where(torch.rand(400, generator=g) < 0.3, 1.0, -1.0).to(F64) * (0.5 + torch.rand(400, generator=g))
    s0 = bapo_search_bounds(r, a, mask, _bapo(high_range=(1.2, 1.2), low_range=(0.6, 0.6)))[2]
    found = set()
    for delta in (-0.05, 0.01, 0.03, 0.5):  # no search / stops within c_high / exhausts c_high / saturates
        cfg = _bapo(target_share=s0 + delta)
        c_low, c_high, share = bapo_search_bounds(r, a, mask, cfg)
        ref_low, ref_high = _bapo_reference(r, a, cfg)
        assert (c_low, c_high) == pytest.approx((ref_low, ref_high), abs=1e-9)
        found.add((round(c_low, 6), round(c_high, 6)))
    assert len(found) == 4, found  # every branch of the search was exercised
    # 'low_first' + 'gradient_mass' (official order, §8 subtlety): raising c_low now helps the share.
    cfg = _bapo(target_share=s0 + 0.03, order="low_first", contribution="gradient_mass")
    c_low, c_high, share = bapo_search_bounds(r, a, mask, cfg)
    assert c_low > 0.6 and share >= s0 + 0.03 - 1e-12
    # Gradient: PPO-clip with the found bounds.
    logp = (r.log() - 1.0).requires_grad_()
    old = torch.full_like(r, -1.0)
    (gr,) = torch.autograd.grad(token_losses("bapo", logp, old, a).sum(), logp)
    c_low, c_high, _ = bapo_search_bounds(r, a, mask, LossConfig(method="bapo"))
    w = torch.where(a > 0, r <= c_high, r >= c_low).to(F64)
    w = torch.where((a < 0) & (r > 3.0), 0.0, w)  # verl's dual-clip c = 3, on by default
    assert ((a < 0) & (r > 3.0)).any()
    torch.testing.assert_close(gr, -w * r * a)


def test_quatro_dual_solvers():
    logp, old, adv, mask, seq = _batch(seed=6)
    prompt = seq // 3  # two prompts of three responses
    n = int(mask.sum())
    cfg = LossConfig(method="quatro", quatro=QuatroParams(dual_solver="dual_ascent", lambda_init=0.2,
                                                          lambda_lr=0.5, delta=0.01))
    _, met = compute_policy_loss(cfg, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n,
        prompt_ids=prompt))
    lr = (logp.detach() - old)
    d = lr.exp() * lr
    lam = []
    for q in (0, 1):
        sel = mask & (prompt == q)
        lam.append(min(max(0.2 + 0.5 * (d[sel].mean().item() - 0.01), 0.0), 100.0))
    want = sum(lam[q] * int((mask & (prompt == q)).sum()) for q in (0, 1)) / n
    assert met["quatro/lambda_mean"].item() == pytest.approx(want)
    # REPS: the chosen λ minimises the dual up to the grid resolution.
    adv_S = torch.tensor([1.0, -0.5, -0.5, 2.0, 0.3, -1.0], dtype=F64)
    p_of_s = torch.tensor([0, 0, 0, 1, 1, 1])
    c = LossConfig(method="quatro", quatro=QuatroParams(dual_solver="reps_closed_form", delta=0.05))
    lam_q = reps_lambda(adv_S, p_of_s, 2, c)
    for q in (0, 1):
        a = adv_S[p_of_s == q]

        def dual(x, a=a):
            return x * 0.05 + x * (torch.logsumexp(a / x, 0) - math.log(len(a)))

        dense = torch.logspace(-4, 2, 20001, dtype=F64)
        best = min(dual(x).item() for x in dense[::10])
        assert dual(lam_q[q]).item() <= best + 1e-3
    with pytest.raises(ValueError, match="prompt_ids"):
        compute_policy_loss(cfg, LossInputs(
            logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n))
    reps = LossConfig(method="quatro", quatro=QuatroParams(dual_solver="reps_closed_form"))
    loss, _ = compute_policy_loss(reps, LossInputs(
        logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, num_tokens_global=n,
        prompt_ids=prompt, seq_ids=seq))
    assert torch.isfinite(loss)


def test_loss_package_imports_without_megatron():
    import subprocess
    import sys

    code = ("import sys, megatron_maspo.loss; "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
