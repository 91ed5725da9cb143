"""``maspo check``: will a recipe's first cluster run reach its first update? Every shape, no GPU.

Builds the real Megatron model of every distinct model-parallel rank of the layout on the meta device and
runs the steps that need shapes but not numbers: conversion tables against the real parameter names (both
directions, local and TE names), the checkpoint's sharded keys, the weight sync's bucket plan, engine
placement per node, the process groups' backends on GPUs, the rollout pool's host shared memory and the
memory plan (``megatron_maspo/check/run.py``). Default layout: the recipe's
documented one (``parallel.world_size`` on 8-GPU nodes).

    maspo check r1_distill_qwen_7b_maspo
    maspo check qwen3_30b_a3b_maspo --nodes 4 --gpus-per-node 8
    maspo check llama3_70b_maspo --set model.attention_backend=te

Exit status: 0 when every step passed, 1 at the first mismatch (printed with its step), 2 on bad input.
"""

from __future__ import annotations

import argparse

from megatron_maspo.cli.common import add_config_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("check", help="check a recipe's full-size layout shape by shape (meta device)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe_name", nargs="?", default=None, metavar="RECIPE", help="recipe (as --recipe)")
    add_config_args(p)
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's documented layout)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default 8, or the world if smaller)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="GPU memory in GiB for the memory plan (default: that of the recipe's parallel.gpu)")
    p.add_argument("--shm-gb", type=float, default=None,
                   help="/dev/shm per node in GiB: fail when the rollout pool's vLLM staging needs more "
                        "(default: print the need only)")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes building the ranks when there are many (default: this machine's cores)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.check.run import check_config, documented_layout
    from megatron_maspo.cli.common import config_from_args
    from megatron_maspo.errors import ConfigError

    if args.recipe_name:
        if args.recipe:
            raise ConfigError("give the recipe either positionally or with --recipe, not both")
        args.recipe = args.recipe_name
    cfg = config_from_args(args)
    nodes, gpus = documented_layout(cfg)
    nodes = args.nodes if args.nodes is not None else nodes
    gpus = args.gpus_per_node if args.gpus_per_node is not None else gpus
    if nodes < 1 or gpus < 1:
        raise ConfigError(f"--nodes and --gpus-per-node must be >= 1, got {nodes}, {gpus}")
    res = check_config(cfg, nodes=nodes, gpus_per_node=gpus, gpu_mem_gb=args.gpu_mem_gb,
                       node_shm_gb=args.shm_gb, echo=print, jobs=args.jobs)
    return 0 if res.ok else 1
