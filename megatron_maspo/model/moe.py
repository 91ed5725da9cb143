"""MoE settings: validate ``model.moe_*`` fields and turn them into Megatron ``TransformerConfig`` keys.

One place decides the dispatcher, the router's load balancing and precision and routing replay, so
the trainer, the inference policy and the planner (``launch/plan/estimator.py``) read the same values.

Dispatchers in megatron-core 0.16.1 (``transformer/moe/token_dispatcher.py``):

* ``alltoall``: all-to-all-v of the routed tokens over the EP group. Its split sizes are host
  tensors, which the CPU build of ``all_to_all_single`` refuses; ``parallel/cpu_compat.py`` (part
  ``a2a``) turns them into lists on CPU only. Row lengths may differ between EP ranks.
* ``allgather``: every EP rank gathers every token (``[S·EP, H]``); needs equal token counts over
  the EP group, so the actor pads rows (``train/actor/packing.py``, ``equal_rows``).
* ``flex``: DeepEP / HybridEP kernels; GPU only, refused here when CUDA or ``deep_ep`` is missing.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from megatron_maspo.model.moe_router import router_transformer_kwargs
from megatron_maspo.rollout import engines

if TYPE_CHECKING:
    import torch

DISPATCHERS = ("alltoall", "allgather", "flex")
LOAD_BALANCING = ("none", "aux_loss", "seq_aux_loss")
ROUTING_REPLAY = ("off", "old_logprobs", "all")


def validate_moe_fields(m: Any) -> None:
    """Check ``ModelConfig``'s MoE fields one by one (the architecture is not known yet).

    Raises:
        ValueError: a field outside its accepted values (the config loader reports it as a ConfigError).
    """
    if m.moe_dispatcher not in DISPATCHERS:
        raise ValueError(f"model.moe_dispatcher={m.moe_dispatcher!r}; accepted: {DISPATCHERS}")
    if m.moe_load_balancing not in LOAD_BALANCING:
        raise ValueError(f"model.moe_load_balancing={m.moe_load_balancing!r}; accepted: {LOAD_BALANCING}")
    if m.routing_replay not in ROUTING_REPLAY:
        raise ValueError(f"model.routing_replay={m.routing_replay!r}; accepted: {ROUTING_REPLAY}")
    if m.moe_aux_loss_coeff < 0 or m.moe_z_loss_coeff < 0 or m.moe_expert_bias_update_rate < 0:
        raise ValueError("model.moe_aux_loss_coeff, model.moe_z_loss_coeff and "
                         "model.moe_expert_bias_update_rate must be >= 0")
    if m.moe_aux_loss_coeff > 0 and m.moe_load_balancing == "none":
        raise ValueError(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} needs model.moe_load_balancing "
                         "'aux_loss' or 'seq_aux_loss' (it is 'none')")


def flex_available() -> bool:
    """The flex dispatcher's kernels can run here: CUDA plus DeepEP importable."""
    from megatron_maspo.parallel.device import on_cuda  # torch: not when a config is only checked

    return on_cuda() and importlib.util.find_spec("deep_ep") is not None


def moe_build_options(m: Any) -> dict:
    """``ModelBuildOptions`` fields for ``ModelConfig`` ``m`` (dense models ignore them)."""
    return dict(moe_dispatcher=m.moe_dispatcher, moe_load_balancing=m.moe_load_balancing,
                moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_z_loss_coeff=m.moe_z_loss_coeff,
                moe_router_fp32=m.moe_router_fp32, routing_replay=m.routing_replay != "off",
                moe_expert_bias_update=m.moe_expert_bias, moe_expert_bias_update_rate=m.moe_expert_bias_update_rate)


def moe_transformer_kwargs(spec: Any, opts: Any, *, grouped_gemm: bool = False) -> dict:
    """Megatron ``TransformerConfig`` MoE keys for ``spec`` (an MoE ``ArchSpec``) under ``opts``.

    ``grouped_gemm`` must be the layer spec's own choice (``provider.moe_grouped_gemm``): the TE spec's
    ``TEGroupedMLP`` and the config's ``moe_grouped_gemm`` then agree.

    Raises:
        ValueError: ``flex`` without CUDA + DeepEP.
    """
    if opts.moe_dispatcher == "flex" and not flex_available():
        raise ValueError("model.moe_dispatcher='flex' needs CUDA and DeepEP (the deep_ep package); "
                         "use 'alltoall' (any machine) or 'allgather'")
    kw: dict = dict(
        num_moe_experts=spec.num_moe_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        **router_transformer_kwargs(spec, update_expert_bias=opts.moe_expert_bias_update,
                                    expert_bias_update_rate=opts.moe_expert_bias_update_rate),
        moe_router_load_balancing_type=opts.moe_load_balancing,
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        moe_z_loss_coeff=opts.moe_z_loss_coeff or None,
        moe_token_dispatcher_type=opts.moe_dispatcher,
        moe_grouped_gemm=grouped_gemm,
        moe_enable_routing_replay=opts.routing_replay,
        # Experts are never split over TP (Megatron's default expert-TP = TP): HF<->Megatron conversion
        # and weight sync shard experts over EP only (conversion/hf_to_megatron.py).
        expert_tensor_parallel_size=1,
    )
    if opts.moe_dispatcher == "flex":
        kw["moe_flex_dispatcher_backend"] = "deepep"
    if opts.bf16 and opts.moe_router_fp32:
        kw["moe_router_dtype"] = "fp32"  # logits and top-k in fp32; weights kept fp32 by keep_router_fp32
    return kw


def keep_router_fp32(model: torch.nn.Module) -> int:
    """Cast every MoE router's parameters back to fp32 after ``model.bfloat16()``; return how many.

    ``Module.bfloat16()`` casts every floating parameter, the router's included; Megatron's
    ``moe_router_dtype="fp32"`` only up-casts at use, so the weights would still be bf16-rounded.
    The optimizer then treats them as fp32 parameters (no separate master copy needed).
    """
    from megatron.core.transformer.moe.router import Router

    n = 0
    for mod in model.modules():
        if isinstance(mod, Router):
            mod.float()
            n += 1
    return n


def moe_plan_reasons(model: Any, rollout: Any, spec: Any, ep: int) -> list[str]:
    """Why the MoE settings in ``model`` (with ``rollout.engine``) cannot run ``spec`` at expert-parallel size ``ep`` on a GPU
    cluster (``maspo plan``; the planning machine's own CUDA/DeepEP do not matter). Empty = fine.

    The trainer reads the same fields (``moe_build_options``), so a plan that passes here builds.
    """
    m, out = model, []
    if m.moe_dispatcher == "flex" and ep == 1:
        out.append("model.moe_dispatcher='flex' needs ep > 1")
    if m.moe_dispatcher == "allgather" and ep > 8:
        out.append(f"model.moe_dispatcher='allgather' at ep={ep}: every EP rank gathers all {ep} ranks' "
                   "tokens (activation memory and traffic grow with EP); use 'alltoall'")
    refusal = engines.routing_replay_refusal(rollout) if m.routing_replay != "off" else None
    if refusal:
        out.append(f"model.routing_replay: {refusal}")
    return out


def moe_summary(m: Any) -> str:
    """One line with the MoE settings (``model.*``) the trainer will use (``maspo plan`` output)."""
    parts = [f"dispatcher={m.moe_dispatcher}", f"load_balancing={m.moe_load_balancing}"]
    if m.moe_aux_loss_coeff:
        parts.append(f"aux_loss_coeff={m.moe_aux_loss_coeff:g}")
    if m.moe_z_loss_coeff:
        parts.append(f"z_loss_coeff={m.moe_z_loss_coeff:g}")
    parts.append(f"router={'fp32' if (m.moe_router_fp32 or not m.bf16) else 'bf16'}")
    parts.append(f"routing_replay={m.routing_replay}")
    return "moe: " + " ".join(parts)


def check_model_layout(model: Any, parallel: Any, spec: Any) -> None:
    """The run's layout (``parallel.*``) and MoE settings (``model.*``) against the architecture, once it
    is known (start-up).

    Raises:
        ConfigError: naming the ``parallel.*`` / ``model.*`` keys and the constraint.
    """
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.parallel.config import sequence_parallel_on

    p = parallel
    sp = sequence_parallel_on(p.sequence_parallel, model.attention_backend, p.tp, spec.is_moe)
    try:
        spec.validate_layout(p.tp, p.pp, p.ep, p.vpp, sequence_parallel=sp, pp_first=p.pp_first_layers,
                             pp_last=p.pp_last_layers)
    except ValueError as e:
        raise ConfigError(f"parallel.tp={p.tp} parallel.pp={p.pp} parallel.ep={p.ep}: {e}") from None
    if model.moe_expert_bias and not (spec.is_moe and spec.moe_router_expert_bias):
        raise ConfigError(f"model.moe_expert_bias=True (update the router's correction bias) needs a model "
                          f"with one (DeepSeek-V3 / GLM-4.5 sigmoid routers); {spec.family} has none")
    if model.routing_replay != "off" and not spec.is_moe:
        raise ConfigError(f"model.routing_replay={model.routing_replay!r} needs an MoE model "
                          f"({spec.family} is dense)")
