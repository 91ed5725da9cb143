"""Plugins import only from PYTHONPATH or installed packages, and a saved config names its plugins first."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from megatron_maspo.config import MaspoConfig
from megatron_maspo.errors import ConfigError
from megatron_maspo.plugins import announce_plugins, plugin_fields, resolve
from megatron_maspo.reward.config import RewardConfig


def _stray(tmp_path, name: str) -> None:
    (tmp_path / f"{name}.py").write_text(f"import os\nos.environ['MASPO_TEST_IMPORTED_{name}'] = '1'\n"
                                         "def f(r, a):\n    return True\n")


def test_the_working_directory_is_not_searched(tmp_path, monkeypatch):
    _stray(tmp_path, "stray_cwd_mod")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m` does: cwd first on sys.path
    monkeypatch.setenv("PYTHONPATH", "")
    with pytest.raises(ConfigError, match="working directory, which is not searched: run with PYTHONPATH=."):
        resolve("stray_cwd_mod:f", "reward.grader")
    assert "MASPO_TEST_IMPORTED_stray_cwd_mod" not in os.environ
    assert str(tmp_path) in sys.path  # the import left sys.path as it was


def test_pythonpath_naming_the_folder_is_explicit(tmp_path, monkeypatch):
    _stray(tmp_path, "stray_ok_mod")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert resolve("stray_ok_mod:f", "reward.grader")("x", "y") is True
    monkeypatch.delenv("MASPO_TEST_IMPORTED_stray_ok_mod")


def test_a_saved_config_names_its_plugins_before_importing(tmp_path, caplog, monkeypatch):
    _stray(tmp_path, "stray_named_mod")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = MaspoConfig(reward=RewardConfig(grader="stray_named_mod:f"))
    assert plugin_fields(cfg) == [("reward.grader", "stray_named_mod:f")]
    with caplog.at_level(logging.WARNING):
        announce_plugins(cfg, "config runs/x")
    assert "MASPO_TEST_IMPORTED_stray_named_mod" not in os.environ  # named, located, not imported
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("config runs/x names a plugin, reward.grader=stray_named_mod:f") and \
        str(tmp_path / "stray_named_mod.py") in line, line
