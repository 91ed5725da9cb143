"""Resolve a recipe (packaged name, file or module) and apply ``--set`` overrides: the config a command runs.

A recipe is a Python function returning a :class:`~megatron_maspo.config.MaspoConfig`
(``megatron_maspo/recipes/tiny.py: config``). This module sits above :mod:`megatron_maspo.config`;
nothing below it imports recipes.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from megatron_maspo.config import MaspoConfig, check_combinations, load_config
from megatron_maspo.errors import ConfigError
from megatron_maspo.overrides import apply_overrides

_NOT_RECIPES = {"base", "registry"}


def list_recipes() -> list[str]:
    """Names of the packaged recipes (modules of ``megatron_maspo.recipes`` with a ``config()`` function)."""
    import pkgutil

    import megatron_maspo.recipes as recipes

    return sorted(m.name for m in pkgutil.iter_modules(recipes.__path__)
                  if not m.name.startswith("_") and m.name not in _NOT_RECIPES)


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
        from megatron_maspo.plugins import without_cwd

        # A module name is looked up as plugins are: never in the working directory implicitly
        # (``python -m`` and torchrun put it first on sys.path), so a stray ./foo.py is not run by
        # ``--recipe foo``; a file is run only when named as one (``--recipe ./foo.py``).
        try:
            with without_cwd():
                module = importlib.import_module(target)
        except ImportError:
            local = Path(f"{target.split('.')[0]}.py")
            hint = (f"; {local} in the working directory is not searched: pass --recipe ./{local} to run it"
                    if local.is_file() else "")
            raise ConfigError(f"unknown recipe {name!r}; available: {list_recipes()} "
                              f"(or pass path/to/recipe.py[:fn] or package.module[:fn]){hint}") from None
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
