"""Build the pieces the RL loop needs from the root config: policy source, actor, engine, rollout side.

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
from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.moe import check_model_layout
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import default_device
from megatron_maspo.reward.math_reward import MathReward
from megatron_maspo.rollout.builtin_engine import BuiltinEngine, engine_device
from megatron_maspo.rollout.fleet import owner_gpus, processes_per_node
from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender
from megatron_maspo.train.actor.inference import InferencePolicy
from megatron_maspo.train.actor.megatron_actor import MegatronActor
from megatron_maspo.train.observe.memory import PhaseMemory
from megatron_maspo.train.observe.meters import PhaseMeters
from megatron_maspo.train.process import faults
from megatron_maspo.train.process.distributed import JobPools
from megatron_maspo.train.process.faults import FaultInjector
from megatron_maspo.train.rollouts.pool_worker import RolloutWorker, ignore_stop_signals
from megatron_maspo.train.rollouts.remote import RemoteRolloutSide
from megatron_maspo.train.rollouts.shard import EngineShard
from megatron_maspo.train.rollouts.side import RolloutSide

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


def build_engine(cfg: MaspoConfig, spec: ArchSpec, tokenizer: Any, gpus: tuple[int, ...] | None = None, *,
                 colocated: bool = True):
    """The rollout engine (on the sending rank only). Weights arrive through the first sync.

    Args:
        gpus: the engine's node-local GPUs from the fleet layout (``rollout.fleet.owner_gpus``); None =
            the current device (built-in) / vLLM's default. Unused on CPU.
        colocated: False in the disaggregated rollout pool: the engine never sleeps there (vLLM starts
            without its sleep mode on GPU).
    """
    hf_cfg = hf_config_dict(spec)
    if cfg.rollout.engine == "builtin":
        engine = BuiltinEngine.from_hf_config(hf_cfg, dtype=cfg.model.torch_dtype, device=engine_device(gpus))
        engine.record_routing = cfg.model.routing_replay != "off"  # MoE routing replay
        return engine
    from megatron_maspo.rollout.vllm_engine import VllmEngine

    return VllmEngine.from_settings(cfg.rollout, spec, dtype_name=cfg.model.dtype_name,
                                     seed=cfg.train.seed, gpus=gpus,
                                     seed_per_request=cfg.train.deterministic, sleep_mode=colocated)


def build_actor(cfg: MaspoConfig, spec: ArchSpec, groups, *, init_weights=None, memory_phase=None):
    """The training actor, given the sections it reads (model, parallel, optim, loss, train, τ)."""
    return MegatronActor(spec, groups, model=cfg.model, parallel=cfg.parallel, optim=cfg.optim,
                         loss=cfg.loss, train=cfg.train, temperature=cfg.rollout.temperature,
                         init_weights=init_weights, memory_phase=memory_phase)


def build_inference_policy(cfg: MaspoConfig, spec: ArchSpec, groups, *, init_weights=None):
    """The frozen policy of ``maspo eval`` (model and parallel sections only)."""
    return InferencePolicy(spec, groups, model=cfg.model, parallel=cfg.parallel, init_weights=init_weights)


def build_rollout_side(cfg: MaspoConfig, *, rank: int, fleet, spec: ArchSpec, tokenizer: Any,
                       examples: list, state: dict, version_offset: int, meters, start_engine=None):
    """This rank's engine shard (engine + grader where it owns an engine) on ``fleet``, and the side.

    ``start_engine(build)``: how the engine starts (the colocation order: trainer offloaded while the
    engine sizes its KV cache); called on every rank, with ``build`` None where the rank owns no engine.
    """
    engine_id = fleet.engine_of(rank)
    build = (partial(build_engine, cfg, spec, tokenizer, gpus=owner_gpus(fleet, rank))
             if engine_id is not None else None)
    # ``start_engine(build)`` runs on every rank (its barriers are collective): Colocation.start_engine
    engine = start_engine(build) if start_engine is not None else (build() if build is not None else None)
    shard = None
    if engine_id is not None:
        shard = EngineShard(engine, engine_id=engine_id, fleet=fleet,
                            tokenizer=tokenizer, examples=examples, grader=MathReward(cfg.reward),
                            rollout=cfg.rollout, seed=cfg.train.seed,
                            overlong_buffer=cfg.train.overlong_buffer, version_offset=version_offset,
                            meters=meters)
    return RolloutSide(shard, fleet, num_examples=len(examples), rollout=cfg.rollout, train=cfg.train,
                       state=state, version_offset=version_offset)


# ---------------------------------------------------------------------------- disaggregated placement
def _bridges(cfg: MaspoConfig, pools: JobPools) -> tuple[comm.Bridge | None, comm.Bridge | None,
                                                         comm.Bridge | None]:
    """This rank's ``weights`` (device: bucket bytes), ``weights_ctl`` (host: bucket headers, end, stop) and
    ``batches`` (host: pickled batches) bridges, None where it is not a member; built in that order on every
    rank (a bridge's members block in its constructor until all have joined, for up to
    ``rollout.pool_timeout_s``)."""
    lay, rank = pools.layout, pools.rank
    timeout = cfg.rollout.pool_timeout_s
    weights = ctl = batches = None
    if rank in lay.weights_ranks:
        weights = comm.Bridge(pools.store, "weights", lay.weights_ranks, rank, device=True, timeout_s=timeout)
        ctl = comm.Bridge(pools.store, "weights_ctl", lay.weights_ranks, rank, timeout_s=timeout)
    if rank in lay.batches_ranks:
        batches = comm.Bridge(pools.store, "batches", lay.batches_ranks, rank, timeout_s=timeout)
    return weights, ctl, batches


def build_remote_side(cfg: MaspoConfig, pools: JobPools, *, state: dict, version_offset: int) -> RemoteRolloutSide:
    """The training pool's rollout side: batches from the rollout pool, weights to it (rank 0)."""
    weights, ctl, batches = _bridges(cfg, pools)
    return RemoteRolloutSide(pools.layout, batches=batches,
                             sender=WeightSender(weights, ctl) if weights is not None else None,
                             rollout=cfg.rollout, train=cfg.train, state=state, version_offset=version_offset)


def run_rollout_pool(cfg: MaspoConfig, pools: JobPools) -> int:
    """One rank of the rollout pool: its engine (on owner ranks), grader and data, then
    :class:`RolloutWorker` until the trainer says stop; returns the batches made."""
    lay = pools.layout
    tokenizer, spec, _ = build_policy_source(cfg, None)  # weights come with the first sync
    examples, _ = build_prompt_dataset(cfg.data, tokenizer)
    fleet, pool_rank = lay.fleet, lay.pool_rank(pools.rank)
    engine_id = fleet.engine_of(pool_rank)
    weights, ctl, batches = _bridges(cfg, pools)
    shard = receiver = None
    if engine_id is not None:
        gpus = lay.placement(processes_per_node(lay.world))[engine_id].gpus
        engine = build_engine(cfg, spec, tokenizer, gpus=gpus, colocated=False)
        staging = getattr(engine, "staging_pool", lambda: None)()  # vLLM ipc: shared-memory staging
        receiver = WeightReceiver(weights, ctl, device=getattr(engine, "device", "cpu"), staging=staging)
        shard = EngineShard(engine, engine_id=engine_id, fleet=fleet, tokenizer=tokenizer, examples=examples,
                            grader=MathReward(cfg.reward), rollout=cfg.rollout, seed=cfg.train.seed,
                            overlong_buffer=cfg.train.overlong_buffer, version_offset=0,
                            meters=PhaseMeters(PhaseMemory(default_device())))
    ignore_stop_signals()  # the trainer decides when the pool stops (after its checkpoint)
    worker = RolloutWorker(shard, fleet, receiver=receiver, batches=batches, rollout=cfg.rollout,
                           train=cfg.train, num_examples=len(examples),
                           faults=FaultInjector(faults.configured(), pools.rank))
    try:
        made = worker.run()
    finally:
        if shard is not None:
            shard.close()
            getattr(shard.engine, "shutdown", lambda: None)()
    if receiver is not None:
        receiver.join()
    logger.info("rollout pool rank %d: %d batches made", pool_rank, made)
    return made
