"""The root config: recipes load, YAML round-trips exactly, validation names the field."""

from __future__ import annotations

import pytest

from megatron_maspo.config import MaspoConfig, load_config, save_config
from megatron_maspo.recipes.registry import list_recipes, load_recipe, resolve_config


def test_tiny_recipe_round_trips_through_yaml(tmp_path):
    cfg = load_recipe("tiny")
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path) == cfg  # a run directory works too


def test_every_recipe_builds():
    names = list_recipes()
    assert "tiny" in names
    for n in names:
        assert isinstance(load_recipe(n), MaspoConfig), n


def test_unknown_recipe_lists_available():
    with pytest.raises(ValueError, match="available: .*tiny"):
        load_recipe("no_such_recipe")


def test_overrides_revalidate_sections():
    cfg = resolve_config("tiny", None, ["loss.method=grpo", "rollout.group_size=4"])
    assert cfg.loss.method == "grpo" and cfg.rollout.group_size == 4
    with pytest.raises(ValueError, match="rollout.group_size"):
        resolve_config("tiny", None, ["rollout.group_size=1"])
    with pytest.raises(ValueError, match="rollout.engine"):
        resolve_config("tiny", None, ["rollout.engine=sglang"])


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_trainer_sections_keep_their_old_import_path():
    """They live in ``train_config.py`` (the root config imports no ``train/``); ``train.config`` re-exports."""
    from megatron_maspo import train_config
    from megatron_maspo.train import config as old

    for name in ("CHECKPOINT_SUBDIR", "CheckpointConfig", "LoggingConfig", "OptimConfig", "TrainConfig"):
        assert getattr(old, name) is getattr(train_config, name)
    assert MaspoConfig().train.__class__ is train_config.TrainConfig
