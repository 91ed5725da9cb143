"""Build the pieces the RL loop needs from the root config: policy source, actor, engine, rollout source.

These builders are the only functions under ``train/`` that take the root :class:`MaspoConfig`: each
hands every component just the config sections it uses. Kept apart from ``loop.py`` so the loop reads
like pseudo-code and each factory can be tested alone.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from megatron_maspo.config import MaspoConfig
from megatron_maspo.conversion.dist_ckpt import load_model_checkpoint
from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
from megatron_maspo.data.dataset import build_prompt_dataset
from megatron_maspo.data.tokenizer import build_byte_tokenizer
from megatron_maspo.model.hf_config import arch_spec_from_hf
from megatron_maspo.model.moe import check_model_layout
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.launch import free_port
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.fleet import owner_gpus, processes_per_node
from megatron_maspo.train.actor.inference import InferencePolicy
from megatron_maspo.train.actor.megatron_actor import MegatronActor
from megatron_maspo.train.process.distributed import JobPools
from megatron_maspo.train.rollouts.pool import build_remote_side, run_rollout_pool
from megatron_maspo.train.rollouts.shard import make_shard
from megatron_maspo.train.rollouts.side import RolloutSide, RolloutSource

logger = logging.getLogger(__name__)


def build_policy_source(cfg: MaspoConfig, groups) -> tuple[Any, ArchSpec, Any]:
    """Tokenizer, architecture and a weight initialiser for the actor.

    ``model.source="tiny"``: the in-code byte tokenizer and a tiny Qwen2-style model with Megatron's
    seeded initialisation. Otherwise an HF folder: its tokenizer, its config.json and its safetensors
    (streamed into the Megatron shards).

    Raises:
        FileNotFoundError: the HF folder or its config.json is missing.
    """
    if cfg.model.source == "tiny":

        tok = build_byte_tokenizer()
        spec = tiny_qwen2_spec(vocab_size=len(tok), num_layers=cfg.model.tiny_num_layers,
                               hidden_size=cfg.model.tiny_hidden_size)
        ckpt = cfg.model.megatron_checkpoint
        return tok, spec, (partial(_load_megatron, path=ckpt) if ckpt else None)

    src = Path(cfg.model.source)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"model.source={cfg.model.source!r} is neither 'tiny' nor an HF folder "
                                "with config.json")
    tok = AutoTokenizer.from_pretrained(str(src))
    spec = arch_spec_from_hf(str(src))
    check_model_layout(cfg.model, cfg.parallel, spec)  # e.g. MoE at TP > 1 without sequence parallelism: one-line error
    if cfg.model.megatron_checkpoint:
        init = partial(_load_megatron, path=cfg.model.megatron_checkpoint)
    else:
        init = partial(_load_hf, spec=spec, groups=groups, src=src)
    return tok, spec, init


def _load_megatron(chunks, *, path):
    """Initial weights from a Megatron dist-checkpoint (any TP/PP layout), before DDP and optimizer."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.megatron_checkpoint={path!r}: no such checkpoint folder")
    load_model_checkpoint(chunks, path)


def _load_hf(chunks, *, spec, groups, src):

    load_hf_weights(chunks, spec, groups, src)


def build_engine(cfg: MaspoConfig, spec: ArchSpec, gpus: tuple[int, ...] | None = None, *,
                 colocated: bool = True, span=None):
    """The rollout engine of ``rollout.engine`` (on engine-owning ranks only): ``rollout/engines.py``'s
    builder with this run's sections. Weights arrive through the first sync.

    Args:
        gpus: the engine's node-local GPUs from the fleet layout (``rollout.fleet.owner_gpus``); None =
            the current device (built-in) / vLLM's default. Unused on CPU.
        colocated: False in the disaggregated rollout pool: the engine never sleeps there (vLLM starts
            without its sleep mode on GPU).
        span: this rank's part of an engine larger than a node (``rollout/engine_span.py``).
    """
    return engines.build_engine(cfg.rollout, cfg.model, spec, seed=cfg.train.seed,
                                deterministic=cfg.train.deterministic, gpus=gpus, colocated=colocated, span=span)


def build_actor(cfg: MaspoConfig, spec: ArchSpec, groups, *, init_weights=None, memory_phase=None):
    """The training actor, given the sections it reads (model, parallel, optim, loss, train, τ)."""
    return MegatronActor(spec, groups, model=cfg.model, parallel=cfg.parallel, optim=cfg.optim,
                         loss=cfg.loss, train=cfg.train, temperature=cfg.rollout.temperature,
                         init_weights=init_weights, memory_phase=memory_phase)


def build_inference_policy(cfg: MaspoConfig, spec: ArchSpec, groups, *, init_weights=None):
    """The frozen policy of ``maspo eval`` (model and parallel sections only)."""
    return InferencePolicy(spec, groups, model=cfg.model, parallel=cfg.parallel, init_weights=init_weights)


def build_rollout_source(cfg: MaspoConfig, *, pools: JobPools | None, rank: int, fleet, spec: ArchSpec,
                         tokenizer: Any, examples: list, state: dict, version_offset: int, meters,
                         start_engine=None) -> RolloutSource:
    """Where the loop's batches come from: the rollout pool (disaggregated: ``pools``), else this rank's
    engine shard (engine + grader where it owns an engine) on ``fleet`` and the colocated side.

    ``start_engine(build)``: how the engine starts (the colocation order: trainer offloaded while the
    engine sizes its KV cache); called on every rank, with ``build`` None where the rank owns no engine.
    """
    if pools is not None:
        return build_remote_side(pools, rollout=cfg.rollout, train=cfg.train, state=state,
                                 version_offset=version_offset)
    engine_id = fleet.engine_of(rank)
    span, hosted = spanning_part(fleet, rank), []
    build = (partial(build_engine, cfg, spec, gpus=owner_gpus(fleet, rank), span=span)
             if engine_id is not None else None)
    if span is not None and not span.head:  # a further node's leader: that node's workers, no engine here
        gpus = fleet.placement_of(span.engine, processes_per_node(fleet.world)).gpus
        build = partial(_host_node_workers, hosted, partial(build_engine, cfg, spec, gpus=gpus, span=span))
    # ``start_engine(build)`` runs on every rank (its barriers are collective): Colocation.start_engine
    engine = start_engine(build) if start_engine is not None else (build() if build is not None else None)
    shard = None
    if engine_id is not None:
        shard = make_shard(engine, engine_id=engine_id, fleet=fleet, tokenizer=tokenizer, examples=examples,
                           rollout=cfg.rollout, train=cfg.train, reward=cfg.reward,
                           version_offset=version_offset, meters=meters)
    side = RolloutSide(shard, fleet, num_examples=len(examples), rollout=cfg.rollout, train=cfg.train,
                       state=state, version_offset=version_offset)
    side.hosted = hosted  # a node leader keeps its part of a spanning engine for the run (vLLM stops it at exit)
    return side


def spanning_part(fleet, rank: int):
    """This rank's :class:`~megatron_maspo.rollout.engine_span.EngineSpan` (None unless it leads a node of
    an engine larger than a node). Collective over the default group when any engine spans nodes."""
    from megatron_maspo.rollout import engine_span

    placements = fleet.placement(processes_per_node(fleet.world))
    if not engine_span.any_spans(placements):
        return None
    return engine_span.rendezvous(placements, rank, all_gather=comm.all_gather_object, free_port=free_port)


def _host_node_workers(hosted: list, build):
    """Start a further node's workers and keep them (``hosted``); the rank owns no engine (None): the owner's
    engine drives them, sleep and wake included."""
    hosted.append(build())
    return None


def serve_rollout_pool(cfg: MaspoConfig, pools: JobPools) -> int:
    """A rollout-pool rank's whole life (``train/rollouts/pool.py::run_rollout_pool``) with this run's
    tokenizer, architecture and prompts; weights come with the first sync. Returns the batches made."""
    tokenizer, spec, _ = build_policy_source(cfg, None)
    examples, _ = build_prompt_dataset(cfg.data, tokenizer)
    return run_rollout_pool(pools, rollout=cfg.rollout, model=cfg.model, train=cfg.train, reward=cfg.reward,
                            spec=spec, tokenizer=tokenizer, examples=examples, run_dir=cfg.checkpoint.run_dir)
