"""Detached loss telemetry (loss-formulas.md §13.10).

Every value is pre-normalised by the *global* count (tokens), so one SUM all-reduce over DP of the
per-micro-batch sums gives the global mean. Exceptions, handled by `reduce_metrics`: keys ending in
``min`` / ``max`` reduce with MIN / MAX, and ``loss/nonfinite_tokens`` is a raw count (SUM).
Conditional means come as reducible pairs: ``gate/w_pos`` (Σ_{Â>0} w / N) with ``tokens/pos_frac``,
``maspo/sigma_d{k}`` (Σσ/N) with ``maspo/p_old_frac_d{k}`` (count/N); `finalize_metrics` divides them
after the reduction (``gate/w_mean_pos``, ``maspo/sigma_mean_d{k}``).
Deciles are the fixed bins p_old ∈ [k/10, (k+1)/10) (batch quantiles would not be reducible).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_maspo.loss.base import MethodOutput
from megatron_maspo.parallel import comm

NUM_DECILES = 10


def _extreme_key(key: str) -> str | None:
    if key.endswith("min"):
        return "min"
    if key.endswith("max"):
        return "max"
    return None


def gate_metrics(out: MethodOutput, adv: torch.Tensor, mask: torch.Tensor, n_glob: float,
                 old_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Ratio, clip/attenuation and gate-weight statistics shared by all methods, plus the method's own."""
    m = mask.to(out.ratio.dtype)
    valid = mask.bool()
    r, w = out.ratio, out.weight
    pos, neg = (adv > 0).to(m.dtype) * m, (adv < 0).to(m.dtype) * m

    def mean(x: torch.Tensor, sel: torch.Tensor = m) -> torch.Tensor:
        return (x.to(m.dtype) * sel).sum() / n_glob

    # where + amin/amax instead of boolean indexing: no host sync; an empty call gives ±inf,
    # the identity of the MIN/MAX reduction.
    inf = torch.tensor(float("inf"), dtype=m.dtype, device=m.device)
    met = {
        "ratio/mean": mean(r),
        "ratio/min": torch.where(valid, r, inf).amin() if r.numel() else inf,
        "ratio/max": torch.where(valid, r, -inf).amax() if r.numel() else -inf,
        "tokens/pos_frac": mean(torch.ones_like(r), pos),
        "tokens/neg_frac": mean(torch.ones_like(r), neg),
        "clip/frac_pos": mean(w == 0, pos),
        "clip/frac_neg": mean(w == 0, neg),
        "gate/attenuated_frac_pos": mean(w < 1 - 1e-6, pos),
        "gate/attenuated_frac_neg": mean(w < 1 - 1e-6, neg),
        "gate/w_mean": mean(w),
        "gate/w_pos": mean(w, pos),
        "gate/w_neg": mean(w, neg),
        "gate/w_lt_0.5_frac_pos": mean(w < 0.5, pos),
        "gate/w_lt_0.5_frac_neg": mean(w < 0.5, neg),
        "gate/w_lt_0.9_frac": mean(w < 0.9),
        "gate/w_ratio_mean": mean(w * r),
        "gate/w_ratio_max": torch.where(valid, w * r, -inf).amax() if r.numel() else -inf,
    }
    ex = out.extras
    if "maspo/sigma" in ex:
        met.update(_maspo_metrics(ex, r, adv, m, n_glob, old_logprobs))
    for key in ("dac/low", "dac/high", "quatro/lambda", "quatro/divergence"):
        if key in ex:
            met[f"{key}_mean"] = mean(ex[key])
    for key in ("bapo/c_low", "bapo/c_high", "bapo/pos_share"):
        if key in ex:
            # One value per call, weighted by this call's token share: the SUM is the token-weighted mean.
            met[key] = ex[key] * m.sum() / n_glob
    return met


def _maspo_metrics(extras: dict[str, torch.Tensor], r: torch.Tensor, adv: torch.Tensor,
                   m: torch.Tensor, n_glob: float, old_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """MASPO's ``maspo/*`` metrics from its surrogate's [T] ``maspo/sigma``, ``maspo/cap_hit``."""
    sigma, cap_hit = extras["maspo/sigma"], extras["maspo/cap_hit"]
    p_old = torch.exp(old_logprobs.detach()).to(m.dtype)
    met = {
        "maspo/sigma_mean": (sigma * m).sum() / n_glob,
        "maspo/sigma_cap_frac": (cap_hit.to(m.dtype) * m).sum() / n_glob,
        "maspo/long_tail_frac": ((p_old < 1e-3).to(m.dtype) * m).sum() / n_glob,
    }
    for c in (3, 10):  # what a dual-clip would have removed (MASPO leaves these ungated)
        met[f"maspo/dual_clip_c{c}_would_fire_frac"] = (((adv < 0) & (r > c)).to(m.dtype) * m).sum() / n_glob
    decile = torch.clamp((p_old * NUM_DECILES).long(), max=NUM_DECILES - 1)
    sig_sum = torch.zeros(NUM_DECILES, dtype=m.dtype, device=m.device).index_add_(0, decile, sigma.to(m.dtype) * m)
    cnt = torch.zeros(NUM_DECILES, dtype=m.dtype, device=m.device).index_add_(0, decile, m)
    for k in range(NUM_DECILES):
        met[f"maspo/sigma_d{k}"] = sig_sum[k] / n_glob
        met[f"maspo/p_old_frac_d{k}"] = cnt[k] / n_glob
    return met


def accumulate_metrics(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine two micro-batches' metrics locally (SUM, or MIN/MAX for extreme keys)."""
    out = dict(acc)
    for k, v in new.items():
        if k not in out:
            out[k] = v.clone()
        elif _extreme_key(k) == "min":
            out[k] = torch.minimum(out[k], v)
        elif _extreme_key(k) == "max":
            out[k] = torch.maximum(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def reduce_metrics(metrics: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
                   ) -> dict[str, torch.Tensor]:
    """All-reduce metrics over ``group`` once per step: 3 collectives (SUM, MIN, MAX) in total.

    ``group=None`` only stacks and casts (single process).
    """
    keys = sorted(metrics)
    out: dict[str, torch.Tensor] = {}
    for kind, op in ((None, dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        sel = [k for k in keys if _extreme_key(k) == kind]
        if not sel:
            continue
        buf = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in sel])
        if group is not None:
            comm.all_reduce(buf, op=op, group=group)
        out.update(zip(sel, buf.unbind(0)))
    return out


def finalize_metrics(reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """After `reduce_metrics`: add conditional means, NaN where the condition is empty.

    ``gate/w_mean_{pos,neg}`` (gate weight mean over Â>0 / Â<0 tokens) and
    ``maspo/sigma_mean_d{k}`` (MASPO's effective σ per p_old decile).
    """
    out = dict(reduced)
    nan = float("nan")
    for sign in ("pos", "neg"):
        if f"gate/w_{sign}" in out:
            cnt = out[f"tokens/{sign}_frac"]
            out[f"gate/w_mean_{sign}"] = torch.where(cnt > 0, out[f"gate/w_{sign}"] / cnt,
                                                     torch.full_like(cnt, nan))
    for k in range(NUM_DECILES):
        if f"maspo/sigma_d{k}" in out:
            cnt = out[f"maspo/p_old_frac_d{k}"]
            out[f"maspo/sigma_mean_d{k}"] = torch.where(cnt > 0, out[f"maspo/sigma_d{k}"] / cnt,
                                                        torch.full_like(cnt, float("nan")))
    return out
