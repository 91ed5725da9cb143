"""Built-in engine placement and sleep: level 2 frees the weights' storage and a sync restores them exactly;
level 1 keeps them; on CUDA the model, inputs and sampling live on the GPU (``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout.builtin_engine import BuiltinEngine, default_engine_device
from megatron_maspo.rollout.types import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=11)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def test_default_device_follows_cuda():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_engine_device().type == want
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.spec import tiny_qwen2_spec

    eng = BuiltinEngine.from_hf_config(hf_config_dict(tiny_qwen2_spec(vocab_size=64, num_layers=1,
                                                                      hidden_size=32)))
    assert eng.device.type == want and next(eng.model.parameters()).device.type == want
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    assert BuiltinEngine(model).device == torch.device("cpu")  # a given model stays where it is


def test_level2_sleep_frees_weights_and_a_sync_restores_identical_sampling():
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    eng = BuiltinEngine(model, device="cpu")
    w = _weights(eng.model)
    before = eng.generate(PROMPTS, PARAMS)
    eng.sleep(2)
    assert all(p.numel() == 0 for p in eng.model.parameters()), "level 2 must free the weight storage"
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.wake_up()
    eng.load_weights(w.items())
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # still tied
    after = eng.generate(PROMPTS, PARAMS)
    assert [[c.token_ids for c in g] for g in after] == [[c.token_ids for c in g] for g in before]
    assert [[c.logprobs for c in g] for g in after] == [[c.logprobs for c in g] for g in before]


def test_level1_sleep_keeps_weights():
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    eng = BuiltinEngine(model, device="cpu")
    w = _weights(eng.model)
    eng.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, PARAMS)
    eng.wake_up()
    assert all(torch.equal(w[n], p) for n, p in eng.model.named_parameters())


@pytest.mark.gpu
def test_engine_runs_on_cuda_and_matches_cpu_greedy():
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    cpu = BuiltinEngine(model, device="cpu")
    greedy = SamplingParams(n=1, temperature=0, max_tokens=6)
    ref = cpu.generate(PROMPTS, greedy)
    gpu = BuiltinEngine(make_tiny_hf_model("qwen2", vocab_size=301, seed=0)[0], device="cuda")
    assert next(gpu.model.parameters()).device.type == "cuda"
    out = gpu.generate(PROMPTS, greedy)
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in ref]
    gpu.sleep(1)
    assert next(gpu.model.parameters()).device.type == "cpu"
    gpu.wake_up()
    assert next(gpu.model.parameters()).device.type == "cuda"
