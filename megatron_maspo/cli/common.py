"""Arguments shared by the subcommands that take a config: --recipe, --config, --set, --print-config."""

from __future__ import annotations

import argparse
import os
import sys


def add_config_args(p: argparse.ArgumentParser) -> None:
    """Add the config-selection arguments to a subcommand parser."""
    p.add_argument("--recipe", default=None,
                   help="packaged recipe name (default: tiny; `maspo recipes` lists them), path/to/recipe.py[:fn] "
                        "or module[:fn]")
    p.add_argument("--config", default=None,
                   help="a saved config.yaml (or a run directory holding one) instead of a recipe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. --set loss.maspo.alpha=0.5 (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit (what each field means: docs/config.md)")


def launcher_overrides(overrides: list[str], env: dict[str, str]) -> list[str]:
    """``overrides`` with ``parallel.world_size`` from the launcher's ``WORLD_SIZE`` first (torchrun sets it).

    Under ``torchrun --nproc-per-node 2 ... --set parallel.tp=2`` the world is 2 whatever the recipe says;
    an explicit ``--set parallel.world_size=...`` still wins (and is checked against the real world later).
    """
    ws = env.get("WORLD_SIZE")
    if not ws or any(o.split("=", 1)[0].strip() == "parallel.world_size" for o in overrides):
        return list(overrides)
    return [f"parallel.world_size={ws}", *overrides]


def config_from_args(args: argparse.Namespace):
    """Resolve the config of ``args``; print it and exit when --print-config was given."""
    from megatron_maspo.config import dump_yaml
    from megatron_maspo.recipes.registry import resolve_config

    overrides = list(args.overrides or [])
    world = os.environ.get("WORLD_SIZE")  # under torchrun: the world the layout must divide
    if world and not any(o.split("=", 1)[0].strip() == "parallel.world_size" for o in overrides):
        overrides.insert(0, f"parallel.world_size={int(world)}")
    cfg = resolve_config(args.recipe, args.config, overrides)
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        raise SystemExit(0)
    return cfg
