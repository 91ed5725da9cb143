"""Name -> surrogate registry and the lightweight entry `token_losses`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from megatron_maspo.loss.bapo import bapo
from megatron_maspo.loss.base import MethodOutput, TokenContext
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.gspo import gspo
from megatron_maspo.loss.maspo import maspo
from megatron_maspo.loss.ppo import cispo, dac, gppo, grpo
from megatron_maspo.loss.quatro import quatro
from megatron_maspo.loss.sapo import sapo

SurrogateFn = Callable[[LossConfig, torch.Tensor, torch.Tensor, torch.Tensor, TokenContext], MethodOutput]

METHOD_REGISTRY: dict[str, SurrogateFn] = {
    "grpo": grpo,
    "clip_higher": grpo,  # same PPO-clip, decoupled eps_low / eps_high (DAPO)
    "dac": dac,
    "bapo": bapo,
    "bapo_code": bapo,  # the same surrogate with the released code's group (loss.bapo_code)
    "sapo": sapo,
    "cispo": cispo,
    "gppo": gppo,
    "gspo": gspo,
    "maspo": maspo,
    "quatro": quatro,
}


def check_token_inputs(tensors: Mapping[str, torch.Tensor | None]) -> int:
    """Check that the given tensors are 1-D and of equal length, with sensible dtypes.

    ``tensors`` maps a name (used in the messages, checked in order; None entries are skipped) to
    a tensor. ``*_ids`` must be integer, ``mask`` bool or numeric, everything else floating point.

    Returns:
        T, the common length. Raises ValueError/TypeError naming the offending tensor.
    """
    length: int | None = None
    first = ""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name.endswith("_ids") and (t.is_floating_point() or t.dtype == torch.bool):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if name != "mask" and not name.endswith("_ids") and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be a flat [T] tensor, got shape {tuple(t.shape)}")
        if length is None:
            length, first = t.shape[0], name
        elif t.shape[0] != length:
            raise ValueError(f"{name} has {t.shape[0]} tokens but {first} has {length}")
    return length or 0


def surrogate(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
              advantages: torch.Tensor, ctx: TokenContext) -> MethodOutput:
    """Dispatch to the registered surrogate ``cfg.method`` (inputs already validated)."""
    try:
        fn = METHOD_REGISTRY[cfg.method]
    except KeyError:
        raise ValueError(f"unknown method {cfg.method!r}; registered: {sorted(METHOD_REGISTRY)}") from None
    return fn(cfg, logprobs, old_logprobs, advantages.detach(), ctx)


def token_losses(method: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                 advantages: torch.Tensor, params: Mapping[str, object] | None = None
                 ) -> torch.Tensor:
    """Per-token loss (negated objective) of ``method`` before aggregation.

    Args:
        method: a registered name (METHOD_REGISTRY).
        logprobs: [T] float, log π_θ of the sampled tokens; the only input that carries gradient.
        old_logprobs: [T] float, log π_old (detached inside).
        advantages: [T] float, Â per token (detached inside).
        params: by name, fields of the method's parameter group (``LossConfig.<method>``: e.g.
            alpha, beta_high for 'maspo'; eps_low, eps_high, dual_clip_c for 'grpo') or scalar
            LossConfig fields (log_ratio_clamp); ``mask``, ``seq_ids``, ``prompt_ids`` and ``dp_group`` are
            also accepted for BAPO / QUATRO / GSPO statistics ('gspo' without ``seq_ids`` treats
            all T tokens as one response).

    Returns:
        [T] loss; all tokens count as valid unless ``mask`` is passed.

    Raises:
        ValueError: unknown method or parameter, bad value, shape mismatch, non-finite input.
    """
    if method not in METHOD_REGISTRY:
        raise ValueError(f"unknown method {method!r}; registered: {sorted(METHOD_REGISTRY)}")
    params: dict[str, Any] = dict(params or {})  # values: config fields or [T] tensors
    ctx_keys = {"mask", "seq_ids", "prompt_ids", "dp_group"}
    if method == "gspo" and params.get("seq_ids") is None:
        # one response by default, as `mask` defaults to all-valid
        params = {**params, "seq_ids": torch.zeros(logprobs.shape[0], dtype=torch.long)}
    default = LossConfig()
    group_cls = type(getattr(default, method))
    own = {f.name for f in fields(group_cls)}
    top = {f.name for f in fields(LossConfig)
           if f.name != "method" and not is_dataclass(getattr(default, f.name))}
    unknown = sorted(set(params) - own - top - ctx_keys)
    if unknown:
        raise ValueError(f"unknown loss parameter(s) {unknown} for {method!r}; accepted: "
                         f"{sorted(own)} (loss.{method}.*) and {sorted(top)}")
    # start from LossConfig's group for this method: its defaults are the method's own
    group = replace(getattr(default, method), **{k: v for k, v in params.items() if k in own})
    cfg = LossConfig(method=method, **{method: group}, **{k: v for k, v in params.items() if k in top})
    mask = params.get("mask")
    check_token_inputs({"logprobs": logprobs, "old_logprobs": old_logprobs,
                        "advantages": advantages, "mask": mask, "seq_ids": params.get("seq_ids"),
                        "prompt_ids": params.get("prompt_ids")})
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} has {int((~torch.isfinite(t)).sum())} non-finite value(s)")
    ctx = TokenContext(mask=torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask.bool(),
                       seq_ids=params.get("seq_ids"), prompt_ids=params.get("prompt_ids"),
                       dp_group=params.get("dp_group"))
    return surrogate(cfg, logprobs, old_logprobs, advantages, ctx).loss
