"""vLLM sampling seeds (issue 29, defect 8a). Before, every request of a step carried the round's seed on
every engine: all prompts shared one random stream. Deterministic runs now seed each request from the
global prompt index (reproducible; vLLM then samples request by request, the documented cost); the GPU
recipes (``train.deterministic=False``) send no request seed and reseed each engine once per call from
(round seed, first prompt), so vLLM samples the batch at once. Runs ``VllmEngine.generate`` against a
recording stand-in."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from megatron_maspo.rollout.sampling import batch_seed
from megatron_maspo.rollout.types import SamplingParams


def test_batch_seed_is_distinct_per_engine_step_and_round_and_reproducible():
    step_seeds = [1234 * 7919 + step * 101 + r for step in range(50) for r in range(3)]
    firsts = [0, 16, 32, 48]  # the shards of 4 engines
    seeds = {batch_seed(s, f) for s in step_seeds for f in firsts}
    assert len(seeds) == len(step_seeds) * len(firsts)
    assert all(0 <= s < 2**63 for s in seeds)
    assert batch_seed(7, 16) == batch_seed(7, 16)


class _Out:
    def __init__(self, n):
        self.outputs = [types.SimpleNamespace(token_ids=[3], logprobs=[{3: types.SimpleNamespace(logprob=-0.5)}],
                                              finish_reason="length") for _ in range(n)]


class _LLM:
    def __init__(self, **kwargs):
        self.rpc: list[tuple] = []
        self.sampling: list[dict] = []

    def collective_rpc(self, name, args=()):
        self.rpc.append((name, *args))
        return [None]

    def generate(self, requests, sp, use_tqdm=False):
        self.sampling.append(sp)
        sps = sp if isinstance(sp, list) else [sp] * len(requests)
        assert len(sps) == len(requests)
        return [_Out(s["n"]) for s in sps]


@pytest.fixture
def make_engine(monkeypatch, tmp_path):
    mod = types.ModuleType("vllm")
    mod.LLM = _LLM
    mod.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", mod)
    from megatron_maspo.rollout.vllm_engine import VllmEngine

    return lambda **kw: VllmEngine(str(tmp_path), **kw)


def test_deterministic_runs_seed_each_request_from_its_global_prompt_index(make_engine):
    engine = make_engine()  # seed_per_request=True: the default, train.deterministic in a run
    engine.generate([[1, 2], [1, 2], [3]], SamplingParams(n=4, temperature=1.0, max_tokens=2, seed=11,
                                                          first_prompt=8))
    assert [sp["seed"] for sp in engine.llm.sampling[-1]] == [batch_seed(11, 8 + i) for i in range(3)]
    assert engine.llm.rpc == []
    engine.generate([[3]], SamplingParams(n=4, temperature=1.0, max_tokens=2, seed=11, first_prompt=10))
    assert engine.llm.sampling[-1][0]["seed"] == batch_seed(11, 10)  # the same prompt, alone: same seed


def test_fast_mode_sends_no_request_seed_and_reseeds_the_workers_once_per_call(make_engine):
    engine = make_engine(seed_per_request=False)  # the GPU recipes (train.deterministic=False)
    engine.generate([[1, 2], [1, 2]], SamplingParams(n=4, temperature=1.0, max_tokens=2, seed=11,
                                                     first_prompt=8))
    assert engine.llm.sampling[-1]["seed"] is None  # batched sampling, no per-request generators
    assert engine.llm.rpc == [("maspo_reseed", batch_seed(11, 8))]
    engine.generate([[1, 2]], SamplingParams(n=1, temperature=0, max_tokens=2, seed=11))  # greedy: no seed
    engine.generate([[1, 2]], SamplingParams(n=1, temperature=1.0, max_tokens=2))  # unseeded: no reseed
    assert len(engine.llm.rpc) == 1 and engine.llm.sampling[-1]["seed"] is None


def test_from_config_follows_train_deterministic(make_engine):
    from megatron_maspo.model.spec import tiny_qwen2_spec
    from megatron_maspo.recipes.registry import load_recipe
    from megatron_maspo.rollout.vllm_engine import VllmEngine
    from megatron_maspo.train.components import build_engine

    spec = tiny_qwen2_spec(vocab_size=64, num_layers=1, hidden_size=32)
    for recipe, per_request in (("tiny", True), ("r1_distill_qwen_7b_maspo", False)):
        cfg = load_recipe(recipe)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
        engine = build_engine(cfg, spec)  # the trainer's builder passes train.deterministic through
        assert isinstance(engine, VllmEngine) and engine.seed_per_request is per_request
