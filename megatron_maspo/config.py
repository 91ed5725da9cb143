"""The root configuration: one dataclass per component, composed; YAML round-trip; recipe loading.

A recipe is a Python function returning a :class:`MaspoConfig` (``megatron_maspo/recipes/tiny.py: config``). The
resolved config is written to ``<run_dir>/config.yaml`` and loads back with :func:`load_config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_maspo.data.config import DataConfig
from megatron_maspo.errors import ConfigError, MissingPathError
from megatron_maspo.eval.config import EvalConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.overrides import apply_overrides, from_dict, to_dict
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig


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
        from megatron_maspo.model.moe import check_moe_cross_section

        check_moe_cross_section(self)


def check_combinations(cfg: MaspoConfig) -> None:
    """Cross-section checks that two ``--set`` overrides satisfy together (run once all are applied,
    so their order does not matter).

    Raises:
        ValueError: a micro-batch token budget below ``data.max_prompt_tokens + rollout.max_new_tokens``
            (the longest sequence a step can hold).
        ValueError: ``rollout.max_staleness > 0`` without ``loss.tis_cap``. Stale samples come from an
            older policy than the recomputed π_old; without the weight π_old/π_rollout the gradient is
            taken under the wrong distribution, a bias that grows with k. Which cap is a method choice,
            so it is asked for rather than silently switched on.
    """
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.train.max_tokens_per_micro_batch < longest:
        # A packed row holds whole sequences; one longer than the budget cannot be placed at all.
        raise ValueError(
            f"train.max_tokens_per_micro_batch={cfg.train.max_tokens_per_micro_batch} is below the longest "
            f"possible sequence, data.max_prompt_tokens + rollout.max_new_tokens = {longest}: raise it, or "
            "lower those two")
    if cfg.rollout.max_staleness > 0 and cfg.loss.tis_cap is None:
        raise ValueError(f"rollout.max_staleness={cfg.rollout.max_staleness} needs loss.tis_cap "
                         "(e.g. 2.0): truncated IS against the stale rollout log-probs")


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


def list_recipes() -> list[str]:
    """Names of the packaged recipes (modules of ``megatron_maspo.recipes`` with a ``config()`` function)."""
    import pkgutil

    import megatron_maspo.recipes as recipes

    return sorted(m.name for m in pkgutil.iter_modules(recipes.__path__)
                  if not m.name.startswith("_") and m.name != "base")


def load_recipe(name: str) -> MaspoConfig:
    """Resolve a recipe: a packaged name (``tiny``), ``path/to/file.py[:fn]`` or ``pkg.module[:fn]``.

    Raises:
        ConfigError: unknown recipe (lists the available ones) or a function that returns no MaspoConfig.
    """
    target, _, fn_name = name.partition(":")
    fn_name = fn_name or "config"
    module = None
    path = Path(target)
    if path.suffix == ".py":
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        # Like running the file as a script: its folder is importable, so a user's recipes can share a
        # local base module with a plain ``from my_base import ...``.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(f"maspo_recipe_{path.stem}", path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif target in list_recipes():
        module = importlib.import_module(f"megatron_maspo.recipes.{target}")
    else:
        try:
            module = importlib.import_module(target)
        except ImportError:
            raise ConfigError(f"unknown recipe {name!r}; available: {list_recipes()} "
                             "(or pass path/to/recipe.py[:fn] or package.module[:fn])") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"recipe {name!r} has no function {fn_name!r}")
    cfg = fn()
    if not isinstance(cfg, MaspoConfig):
        raise ConfigError(f"recipe {name!r}:{fn_name} returned {type(cfg).__name__}, not MaspoConfig")
    return cfg


def resolve_config(recipe: str | None, config_path: str | None, overrides: list[str]) -> MaspoConfig:
    """The config a command runs with: a recipe or a saved config, then ``--set`` overrides.

    Raises:
        ConfigError: any invalid recipe, saved config, override or cross-section combination (every
            ``ValueError`` of loading and validation is re-raised as one, message unchanged).
        MissingPathError: ``config_path`` does not exist.
    """
    if recipe and config_path:
        raise ConfigError("pass either --recipe or --config, not both")
    try:
        cfg = load_config(config_path) if config_path else load_recipe(recipe or "tiny")
        cfg = apply_overrides(cfg, overrides)
        # Re-run cross-section validation after overrides.
        cfg = dataclasses.replace(cfg)
        check_combinations(cfg)
        return cfg
    except ConfigError:
        raise
    except ValueError as e:
        # Validation lives in each section's __post_init__ as plain ValueErrors; here, at the one place
        # a config is assembled, they become configuration errors (the CLI's one-line message).
        raise ConfigError(str(e)) from e
