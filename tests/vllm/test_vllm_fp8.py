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
