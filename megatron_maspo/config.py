"""The root configuration: one dataclass per component, composed; cross-section checks; YAML round-trip.

The resolved config is written to ``<run_dir>/config.yaml`` and loads back with :func:`load_config`.
Recipes (functions returning a :class:`MaspoConfig`) sit above this module:
:mod:`megatron_maspo.recipes.registry` resolves them and applies ``--set`` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_maspo.data.config import DataConfig
from megatron_maspo.errors import MissingPathError
from megatron_maspo.eval.config import EvalConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.overrides import from_dict, to_dict
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train_config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig


@dataclass(kw_only=True)
class MaspoConfig:
    """Everything a run needs. Each section documents and validates its own fields."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        # Cross-section checks; each section validated its own fields already.
        if self.loss.kl_coef > 0 and not self.train.reference_model:
            raise ValueError("loss.kl_coef > 0 needs train.reference_model=true (a frozen reference policy)")
        _check_moe_cross_section(self)


def _check_moe_cross_section(cfg: MaspoConfig) -> None:
    """Combinations of MoE fields with other sections that cannot run (``MaspoConfig.__post_init__``).

    Raises:
        ValueError: naming both keys and the reason.
    """
    m = cfg.model
    refusal = engines.routing_replay_refusal(cfg.rollout) if m.routing_replay != "off" else None
    if refusal:
        raise ValueError(f"model.routing_replay={m.routing_replay!r}: {refusal} (docs/moe.md)")
    if m.routing_replay == "old_logprobs" and cfg.train.check_first_ratio:
        raise ValueError("model.routing_replay='old_logprobs' with train.check_first_ratio=true: the "
                         "training forward routes on its own, so the first ratio is not 1 by design; "
                         "use routing_replay='all' or turn the check off")
    if m.routing_replay == "all" and m.recompute == "full" and cfg.parallel.pp > 1:
        raise ValueError("model.routing_replay='all' with model.recompute='full' and parallel.pp > 1: the "
                         "recomputed forward of a micro-batch runs after later micro-batches were armed")
    if m.moe_dispatcher == "flex" and cfg.parallel.ep == 1:
        raise ValueError("model.moe_dispatcher='flex' needs parallel.ep > 1")


def check_combinations(cfg: MaspoConfig) -> None:
    """Cross-section checks that two ``--set`` overrides satisfy together (run once all are applied,
    so their order does not matter).

    Raises:
        ValueError: a micro-batch token budget below ``data.max_prompt_tokens + rollout.max_new_tokens``
            (the longest sequence a step can hold).
        ValueError: ``rollout.max_staleness > 0`` without a rollout correction (``loss.tis_cap``, or
            ``loss.rollout_correction.mode`` other than 'none'). Stale samples come from an
            older policy than the recomputed π_old; without the weight π_old/π_rollout the gradient is
            taken under the wrong distribution, a bias that grows with k. Which cap is a method choice,
            so it is asked for rather than silently switched on.
    """
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    # the budget counts tokens per context-parallel rank: a row of cp x budget tokens holds a sequence
    if cfg.train.max_tokens_per_micro_batch * cfg.parallel.cp < longest:
        # A packed row holds whole sequences; one longer than the budget cannot be placed at all.
        raise ValueError(
            f"train.max_tokens_per_micro_batch={cfg.train.max_tokens_per_micro_batch}"
            f"{f' x parallel.cp={cfg.parallel.cp}' if cfg.parallel.cp > 1 else ''} is below the longest "
            f"possible sequence, data.max_prompt_tokens + rollout.max_new_tokens = {longest}: raise it, or "
            "lower those two")
    if cfg.rollout.disaggregated:
        _check_disaggregated(cfg)
    if cfg.rollout.max_staleness > 0 and not cfg.loss.corrects_rollout:
        raise ValueError(f"rollout.max_staleness={cfg.rollout.max_staleness} needs loss.tis_cap "
                         "(e.g. 2.0: truncated IS against the stale rollout log-probs) or another "
                         "loss.rollout_correction.mode (token_mask, icepop, seq_mask)")
    if cfg.rollout.vllm_quantization and not cfg.loss.corrects_rollout:
        raise ValueError(f"rollout.vllm_quantization={cfg.rollout.vllm_quantization!r} samples from a quantised "
                         "policy, not the trained one: it needs loss.tis_cap (truncated IS against the "
                         "engine's log-probs) or another loss.rollout_correction.mode (token_mask, icepop, "
                         "seq_mask)")


def _check_disaggregated(cfg: MaspoConfig) -> None:
    """``rollout.placement=disaggregated`` with the rest of the config (docs/disaggregated.md)."""
    rc, tc = cfg.rollout, cfg.train
    if cfg.parallel.world_size <= rc.engine_ranks:
        raise ValueError(f"rollout.placement=disaggregated with rollout.engine_ranks={rc.engine_ranks} needs "
                         f"more ranks than that (parallel.world_size={cfg.parallel.world_size}): launch with "
                         f"torchrun --nproc-per-node {rc.engine_ranks + 1} or more")
    if rc.in_flight_updates and cfg.model.routing_replay != "off":
        raise ValueError("rollout.in_flight_updates with model.routing_replay: a response that spans an "
                         "update was routed by two policies; replay is not defined for it")
    if rc.in_flight_updates and rc.max_staleness < 1:
        raise ValueError("rollout.in_flight_updates needs rollout.max_staleness >= 1 (a response that spans "
                         "an update is off-policy by construction)")
    if cfg.eval.every:
        raise ValueError("eval.every > 0 is not supported with rollout.placement=disaggregated (the engines "
                         "generate ahead of the trainer): evaluate the checkpoints with `maspo eval`")
    if tc.offload_params or tc.offload_grads or tc.offload_optimizer:
        raise ValueError("train.offload_* frees GPU memory for a colocated engine; with "
                         "rollout.placement=disaggregated the engines have GPUs of their own: turn it off")


def dump_yaml(cfg: MaspoConfig) -> str:
    """The config as YAML text."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: MaspoConfig, path: str | Path) -> None:
    """Write the resolved config to ``path`` (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(path)


def load_config(path: str | Path) -> MaspoConfig:
    """Load a config written by :func:`save_config` (a file, or a run directory holding config.yaml).

    Raises:
        MissingPathError: no such file (a ``FileNotFoundError``).
        ValueError: unknown keys or invalid values, naming the key.
    """
    import yaml

    p = Path(path)
    if p.is_dir():
        p = p / "config.yaml"
    if not p.is_file():
        raise MissingPathError(f"config file not found: {p}")
    data = yaml.safe_load(p.read_text()) or {}
    return from_dict(MaspoConfig, data)
