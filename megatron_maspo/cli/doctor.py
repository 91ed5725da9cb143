"""``maspo doctor``: this environment's GPU stack next to the supported set (constraints/gpu.txt), and the
host shared memory a recipe's rollout pool would stage weight syncs into.

    maspo doctor            # versions of torch, CUDA, NCCL, driver, vLLM, TE, Apex, megatron-core,
                            # transformers; the GPUs seen; /dev/shm free; every mismatch and known-broken
                            # combination
    maspo doctor --no-te    # do not import Transformer Engine (its import test can take seconds)
    maspo doctor r1_distill_qwen_7b_maspo --nodes 4 --set rollout.placement=disaggregated \\
        --set rollout.engine=vllm --set rollout.engine_ranks=16 --set rollout.max_staleness=1 \\
        --set loss.tis_cap=2.0   # also: does this machine's /dev/shm hold the busiest node's staged syncs?

Exit status 1 when a known-broken combination is found (the one ``maspo train`` refuses on a GPU) or the
recipe's staging does not fit this machine's free ``/dev/shm``, else 0.
"""

from __future__ import annotations

import argparse

from megatron_maspo.cli.common import add_config_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the GPU stack against the supported set",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-te", action="store_true",
                   help="skip importing Transformer Engine (by default tried when it is installed)")
    p.add_argument("recipe_name", nargs="?", default=None, metavar="RECIPE",
                   help="also check /dev/shm against this recipe's rollout-pool staging (as --recipe)")
    add_config_args(p)
    p.add_argument("--nodes", type=int, default=None, help="nodes of the job (default: the recipe's layout)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default 8, or the world if smaller)")
    p.set_defaults(run=run)


def shm_findings(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]]:
    """The ``/dev/shm`` report row and, with a recipe, the staging finding (``broken`` when it does not fit)."""
    from megatron_maspo.rollout.shm_budget import SHM_PATH, shm_free_bytes, shm_verdict

    free = shm_free_bytes()
    row = f"{'shared memory':<20} " + (f"{free / 2**30:.1f} GiB free in {SHM_PATH}" if free is not None
                                       else f"no {SHM_PATH}")
    if not (args.recipe_name or args.recipe or args.config):
        return row, []
    from megatron_maspo.check.pools import staging_need
    from megatron_maspo.check.run import documented_layout
    from megatron_maspo.cli.common import config_from_args

    if args.recipe_name:
        args.recipe = args.recipe or args.recipe_name
    cfg = config_from_args(args)
    nodes, gpus = documented_layout(cfg)
    need = staging_need(cfg, args.nodes or nodes, args.gpus_per_node or gpus)
    if need is None:
        return row, [("note", "the recipe's engines stage no weight sync in /dev/shm (colocated, built-in "
                              "engine or rollout.weight_transport=bytes)")]
    ok, line = shm_verdict(need[0], free)
    return row, [("note" if ok else "broken", f"rollout-pool staging, {need[1]}: {line}")]


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.stack import collect, findings, format_report

    report = collect(try_te=not args.no_te)
    found = findings(report)
    row, shm = shm_findings(args)
    print(format_report(report, found + shm).replace("\nsupported set:", f"\n{row}\nsupported set:", 1))
    return 1 if any(kind == "broken" for kind, _ in found + shm) else 0
