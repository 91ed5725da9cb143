"""Megatron DDP wrapping, optimizer (AdamW + clipping) and LR schedule for the actor.

Gradient scaling follows loss-formulas.md §2.2: with ``calculate_per_token_loss=True`` DDP sums
gradients (scaling factor 1, ``average_in_collective=False``) and ``finalize_model_grads`` divides
them by the token count all-reduced over DP, which the loss function returns as its second output.

Without Transformer Engine or Apex (CPU, plain CUDA installs) Megatron falls back to
``torch.optim.AdamW`` in its per-tensor loop; :func:`prefer_fused_adam` switches that to PyTorch's
fused kernel (CPU and CUDA): the same update rule, several times faster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_maspo.parallel.groups import gloo_groups_available
from megatron_maspo.train.config import OptimConfig

logger = logging.getLogger(__name__)


@dataclass
class OptimizerBundle:
    """DDP-wrapped model chunks with their optimizer and LR scheduler."""

    chunks: list
    """``DistributedDataParallel`` per virtual-pipeline chunk (``.module`` is the GPTModel)."""
    optimizer: Any
    """Megatron ``MegatronOptimizer`` (a ChainedOptimizer for dense + expert params)."""
    scheduler: Any
    """Megatron ``OptimizerParamScheduler`` (one ``step`` per successful optimizer step)."""


def overlap_options(parallel: Any, *, cuda: bool) -> dict[str, bool]:
    """Resolve ``parallel.overlap_grad_reduce`` / ``overlap_param_gather`` (None = automatic).

    Automatic: gradient-reduce overlap on GPU whenever there is data parallelism to overlap
    (``dp > 1``); parameter-gather overlap additionally needs the distributed optimizer (it is the
    all-gather of the updated shards). An explicit True that Megatron cannot honour raises.

    Args:
        parallel: a ``ParallelConfig`` (``dp``, ``distributed_optimizer`` and the two fields).
        cuda: training runs on GPUs.

    Returns:
        ``{"overlap_grad_reduce": bool, "overlap_param_gather": bool}`` for :func:`build_optimizer`.

    Raises:
        ValueError: ``overlap_param_gather=True`` without the distributed optimizer or without
            gradient-reduce overlap.
    """
    auto = cuda and parallel.dp > 1
    grad = auto if parallel.overlap_grad_reduce is None else parallel.overlap_grad_reduce
    param = parallel.overlap_param_gather
    if param is None:
        param = auto and grad and parallel.distributed_optimizer
    elif param and not (parallel.distributed_optimizer and grad):
        raise ValueError("parallel.overlap_param_gather=True needs parallel.distributed_optimizer=True "
                         "and gradient-reduce overlap (parallel.overlap_grad_reduce not False)")
    return {"overlap_grad_reduce": bool(grad), "overlap_param_gather": bool(param)}


def wrap_ddp(chunks: list, *, distributed_optimizer: bool, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False) -> list:
    """Wrap GPTModel chunks in Megatron DDP with fp32 grad buffers and summed (not averaged) grads.

    Also wires the schedule hooks on the shared ``TransformerConfig``: ``no_sync_func`` (no grad
    sync per micro-batch) and ``finalize_model_grads_func`` (DP all-reduce, tied-embedding sum and
    the 1/N_glob scaling, once per optimizer step).
    """
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=distributed_optimizer, average_in_collective=False)
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c,
                                       disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    cfg = wrapped[0].config
    cfg.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(chunks: list, optim: OptimConfig, *, total_steps: int, bf16: bool,
                    distributed_optimizer: bool, overlap_grad_reduce: bool = False,
                    overlap_param_gather: bool = False, fp16: bool = False) -> OptimizerBundle:
    """DDP-wrap ``chunks`` and build Megatron's AdamW optimizer and LR scheduler.

    Args:
        chunks: unwrapped ``GPTModel`` chunks of this rank (weights already initialised).
        optim: learning rate, betas, weight decay, clipping, warmup and decay style.
        total_steps: optimizer steps of the whole run (decay horizon).
        bf16: bf16 parameters with fp32 master weights (GPU); fp32 otherwise.
        fp16: fp16 parameters with fp32 master weights and Megatron's loss scaler (dynamic unless
            ``optim.loss_scale`` is set; steps with inf/NaN gradients are skipped and the scale backs off).
        distributed_optimizer: shard optimizer state over DP (Megatron DistributedOptimizer).
        overlap_grad_reduce, overlap_param_gather: Megatron DDP overlap (:func:`overlap_options`).
    """
    wrapped = wrap_ddp(chunks, distributed_optimizer=distributed_optimizer,
                       overlap_grad_reduce=overlap_grad_reduce,
                       overlap_param_gather=overlap_param_gather)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=bf16, fp16=fp16,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
        loss_scale=optim.loss_scale, initial_loss_scale=optim.initial_loss_scale,
        min_loss_scale=optim.min_loss_scale, loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.loss_scale_hysteresis,
        use_distributed_optimizer=distributed_optimizer)
    # gloo DP groups only where init_parallel made them (the memory-efficient checkpoint save)
    optimizer = get_megatron_optimizer(ocfg, wrapped, use_gloo_process_groups=gloo_groups_available())
    prefer_fused_adam(optimizer)
    wrapped[0].config.grad_scale_func = optimizer.scale_loss
    steps = max(total_steps, optim.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr,
        min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps, lr_decay_steps=steps,
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
        end_wd=optim.weight_decay, wd_incr_steps=steps, wd_incr_style="constant")
    return OptimizerBundle(chunks=wrapped, optimizer=optimizer, scheduler=scheduler)


def prefer_fused_adam(optimizer: Any) -> int:
    """Switch Megatron's torch ``Adam``/``AdamW`` fallback to PyTorch's fused kernel, in place.

    TE's / Apex's ``FusedAdam`` (what Megatron picks when installed) is left alone. The fused kernel
    needs floating-point parameters on a CPU or CUDA device; otherwise the optimizer is unchanged.

    Returns:
        how many inner optimizers were switched.
    """
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        groups = (inner.defaults, *inner.param_groups)
        params = [p for g in inner.param_groups for p in g["params"]]
        if (not params or any(g.get("differentiable") for g in groups)
                or any(not p.is_floating_point() or p.device.type not in ("cpu", "cuda") for p in params)
                or len({p.device for p in params}) > 1):
            continue
        for group in groups:
            group["fused"], group["foreach"] = True, False
        inner._step_supports_amp_scaling = True  # as torch's constructor does for fused=True
        switched += 1
    if switched:
        logger.info("optimizer: PyTorch fused Adam kernel for %d parameter group set(s)", switched)
    return switched


def grads_finite(wrapped: list) -> bool:
    """True if every local gradient-buffer element is finite (no collective).

    One sum per DDP buffer: any NaN or ±inf element makes the sum non-finite, and a sum of finite
    fp32 gradients only overflows if they reach ~1e38 / numel (a broken step anyway). That is a
    single read of the buffer, against an ``isfinite`` mask of its full size. With the distributed
    optimizer a NaN anywhere reaches some rank's shard after reduce-scatter, so the all-ranks AND
    the actor takes afterwards is exact.
    """
    for w in wrapped:
        for buf in w.buffers + w.expert_parallel_buffers:
            if not bool(torch.isfinite(buf.grad_data.sum())):
                return False
    return True
