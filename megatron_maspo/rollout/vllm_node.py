"""The workers of one further node of a vLLM engine that spans nodes (``rollout/engine_span.py``).

On the leader of node ``j > 0`` of an engine: vLLM's headless multi-node start (what ``vllm serve
--headless --nnodes k --node-rank j`` does for TP across nodes), from the same engine arguments as the
owner's ``vllm.LLM`` (:func:`~.vllm_engine.engine_args`): the engine config with ``headless=True``, then a
``MultiprocExecutor`` that spawns this node's ``gpus_per_node`` workers and returns. The workers join the
owner's TP group at ``master_addr:master_port`` and take every RPC from the owner's engine (sleep, wake,
weight buckets, generation steps) through vLLM's message queue, which reaches remote nodes over TCP. This
process runs no scheduler and takes no prompts; it keeps the executor until :meth:`VllmNodeWorkers.shutdown`.

Versions: vLLM 0.32-0.34 (``ParallelConfig.nnodes`` / ``node_rank`` / ``master_addr`` / ``master_port``,
``distributed_executor_backend="mp"``; no Ray). Not run on the CPU bench (one host, no GPUs); its
arguments are tested, the multi-node start needs a cluster (docs/rollout.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout.engine_span import EngineSpan
from megatron_maspo.rollout.vllm_engine import (
    engine_args,
    engine_devices,
    vllm_headless_config,
    vllm_node_executor,
)

logger = logging.getLogger(__name__)


def headless_config(span: EngineSpan, **engine_kwargs: Any) -> Any:
    """vLLM's engine config for node ``span.node_rank`` of the engine (``EngineArgs(...).create_engine_config
    (headless=True)``): the owner's arguments, this node's rank."""
    if span.head:
        raise ValueError(f"engine {span.engine}: node 0 is the owner's vllm.LLM, not a headless node")
    return vllm_headless_config(**{**engine_kwargs, **span.vllm_kwargs()})


class VllmNodeWorkers:
    """This node's workers of engine ``span.engine`` (a node leader's part; no scheduler, no prompts).

    Args:
        span: the leader's :class:`~.engine_span.EngineSpan` (``node_rank > 0``).
        gpus: the node-local GPUs of the workers (every GPU of the node: ``EnginePlacement.gpus``).
        **engine_kwargs: :func:`~.vllm_engine.engine_args` of the engine (the owner's).
    """

    def __init__(self, span: EngineSpan, *, gpus: Sequence[int] | None = None, **engine_kwargs: Any) -> None:
        self.span = span
        self.gpus = tuple(gpus) if gpus is not None and on_cuda() else None
        config = headless_config(span, **engine_kwargs)
        logger.info("engine %d: starting node %d of %d (workers on local GPUs %s), head at %s:%d", span.engine,
                    span.node_rank, span.nnodes, self.gpus, span.master_addr, span.master_port)
        with engine_devices(self.gpus):
            # the workers are this process's children; a worker that dies ends the executor (logged by vLLM),
            # and the owner's engine then fails its next RPC instead of hanging on this node
            self.executor = vllm_node_executor(config)
        self.executor.start_worker_monitor(inline=False)
        self.label = f"vLLM engine {span.engine} node {span.node_rank}"

    @classmethod
    def from_settings(cls, rollout: Any, model: Any, spec: Any, *, seed: int, deterministic: bool = True,
                      gpus: Sequence[int] | None = None, colocated: bool = True,
                      span: EngineSpan | None = None) -> VllmNodeWorkers:
        """This node's workers for a run (``rollout/engines.py::build_engine`` with a ``span`` of node > 0):
        the engine arguments :meth:`~.vllm_engine.VllmEngine.from_settings` gives the owner."""
        import json
        import os
        import tempfile

        from megatron_maspo.model.hf_config import hf_config_dict
        from megatron_maspo.rollout.vllm_engine import quantization_kwargs

        if span is None:
            raise ValueError("VllmNodeWorkers: a node's workers need its EngineSpan")
        model_dir = tempfile.mkdtemp(prefix="maspo_vllm_node_")
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config_dict(spec), f)
        return cls(span, gpus=gpus, **engine_args(
            model_dir, dtype=model.dtype_name, load_format="dummy", seed=seed,
            max_model_len=spec.max_position_embeddings, gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
            tensor_parallel_size=rollout.vllm_tp, cpu_kv_cache_bytes=rollout.vllm_cpu_kv_cache_mb * 2**20,
            sleep_mode=colocated, span=span, on_gpu=on_cuda(), **quantization_kwargs(rollout)))

    def shutdown(self) -> None:
        """Stop this node's workers now (instead of at interpreter exit)."""
        self.executor.shutdown()
