"""``maspo plan``: will this recipe fit on this cluster, and roughly how long is one RL step?

Prints the per-GPU memory estimate (weights, fp32 grads, optimizer state, activations, the log-prob
chunk, the colocated vLLM share) and a step-time split, for the recipe's layout on ``nodes x gpus``.
A layout that is invalid or does not fit is refused with the reasons, and the nearest fitting layout
(tp / pp / ep / recompute / distributed optimizer / vllm_tp) is printed as ``--set`` overrides.
Formulas and assumptions: ``megatron_maspo/launch/plan/estimator.py``.

    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --gpus-per-node 8
    maspo plan llama3_70b_maspo --nodes 8 --gpus-per-node 8 --set parallel.gpu=h200          # H200
    maspo plan r1_distill_qwen_14b_maspo --nodes 2 --set parallel.tp=2                          # refused?
    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --response-mean 2500 --response-max 8192      # measured lengths
    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --set train.offload_optimizer=true          # host memory it needs
    maspo plan llama3_70b_maspo --nodes 16 --set parallel.cp=2 --set model.attention_backend=te  # CP: planned only
    maspo plan llama3_70b_maspo --nodes 8 --controller-gb-s 0.8   # as a single-controller framework would run it
    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --splits          # colocated vs every disaggregated split
    maspo plan r1_distill_qwen_7b_maspo --nodes 4 --set rollout.placement=disaggregated \
        --set rollout.engine_ranks=16 --set rollout.max_staleness=1 --set loss.tis_cap=2.0   # one split

Every plan ends with the placement comparison: the colocated step beside the best disaggregated split of
the same GPUs (``launch/plan/split.py``, docs/disaggregated.md); ``--splits`` prints every split.

Exit status: 0 when the layout fits, 1 when refused (after printing any suggestion), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_maspo.cli.common import add_config_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="estimate per-GPU memory and step time for a recipe on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe_name", nargs="?", default=None, metavar="RECIPE", help="recipe (as --recipe)")
    add_config_args(p)
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="GPU memory in GiB (default: parallel.gpu's; h100 80, h200 139)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak per GPU (default: parallel.gpu's; 989 for both)")
    p.add_argument("--hbm-tb-s", type=float, default=None,
                   help="HBM bandwidth TB/s (default: parallel.gpu's; h100 3.35, h200 4.8)")
    p.add_argument("--mfu", type=float, default=0.35, help="trainer model-FLOPs utilisation (default 0.35)")
    p.add_argument("--moe-expert-mfu", type=float, default=0.03,
                   help="utilisation of routed-expert FLOPs (grouped GEMM, imbalance; the EP all-to-all is its own "
                        "term; default 0.03)")
    p.add_argument("--decode-eff", type=float, default=0.45,
                   help="fraction of HBM bandwidth a decode step achieves, overheads included (default 0.45)")
    p.add_argument("--decode-step-ms", type=float, default=2.0,
                   help="fixed cost of one engine decode step besides its reads, ms (default 2)")
    p.add_argument("--sync-gb-s", type=float, default=10.0, help="weight-sync bandwidth GB/s (default 10)")
    p.add_argument("--internode-gb-s", type=float, default=40.0,
                   help="inter-node bandwidth per GPU, GB/s: the disaggregated weight broadcast and cross-node "
                        "rings (default 40: 400 Gb/s NDR InfiniBand at ~80%%)")
    p.add_argument("--splits", action="store_true",
                   help="print every disaggregated split of the GPUs beside the colocated plan")
    p.add_argument("--staleness", type=int, default=None,
                   help="k for the placement comparison (default: max(1, rollout.max_staleness))")
    p.add_argument("--controller-gb-s", type=float, default=None,
                   help="plan a single-controller framework that ships each trainer call's padded batch to every "
                        "tp*pp*cp rank, at this (de)serialisation rate in GB/s (default: none, as this trainer)")
    p.add_argument("--prompt-mean", type=float, default=None,
                   help="mean prompt tokens (default: half of data.max_prompt_tokens)")
    p.add_argument("--response-mean", type=float, default=None,
                   help="mean response tokens (default: half of rollout.max_new_tokens)")
    p.add_argument("--response-max", type=float, default=None,
                   help="longest response per engine batch, the straggler tail (default: rollout.max_new_tokens)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.cli.common import config_from_args
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.launch.plan.estimator import (
        apply_layout,
        arch_of,
        estimate,
        layout_of,
        suggest,
    )
    from megatron_maspo.launch.plan.report import format_plan
    from megatron_maspo.launch.plan.types import gpu_assumptions

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes}, {args.gpus_per_node}")
    if args.recipe_name:
        if args.recipe:
            raise ConfigError("give the recipe either positionally or with --recipe, not both")
        args.recipe = args.recipe_name
    world = args.nodes * args.gpus_per_node
    user_overrides = list(args.overrides)
    args.overrides = [f"parallel.world_size={world}", *user_overrides]
    try:
        cfg = config_from_args(args)
    except ValueError:
        # The layout does not divide this world: keep the recipe's world size so the planner can refuse
        # with its reasons and search for one that does.
        args.overrides = user_overrides
        cfg = config_from_args(args)
    if cfg.parallel.world_size != world:
        # The planner sizes for the cluster asked about; the launcher sets world_size the same way.
        print(f"note: recipe's parallel.world_size={cfg.parallel.world_size}; planning for {world} GPUs")
    for name in ("prompt_mean", "response_mean", "response_max"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 tokens, got {getattr(args, name)}")
    if args.controller_gb_s is not None and args.controller_gb_s <= 0:
        raise ConfigError(f"--controller-gb-s must be > 0 GB/s, got {args.controller_gb_s}")
    if args.internode_gb_s <= 0:
        raise ConfigError(f"--internode-gb-s must be > 0 GB/s, got {args.internode_gb_s}")
    if args.staleness is not None and args.staleness < 0:
        raise ConfigError(f"--staleness must be >= 0, got {args.staleness}")
    # the GPU the recipe is sized for (parallel.gpu, e.g. --set parallel.gpu=h200); explicit figures win
    figures = {k: getattr(args, k) for k in ("gpu_mem_gb", "peak_tflops", "hbm_tb_s") if getattr(args, k) is not None}
    hw = gpu_assumptions(cfg.parallel.gpu, **figures, mfu=args.mfu, moe_expert_mfu=args.moe_expert_mfu,
                         decode_bw_eff=args.decode_eff, decode_step_ms=args.decode_step_ms,
                         sync_gb_s=args.sync_gb_s, internode_gb_s=args.internode_gb_s,
                         prompt_mean=args.prompt_mean, response_mean=args.response_mean,
                         response_max=args.response_max, controller_gb_s=args.controller_gb_s)
    spec = arch_of(cfg)
    print(f"model: {cfg.model.arch or cfg.model.source} ({spec.num_parameters() / 1e9:.2f} B parameters) on "
          f"{args.nodes} x {args.gpus_per_node} GPUs of {hw.gpu_mem_gb:.0f} GiB")
    print(f"assumptions: {dataclasses.asdict(hw)}")
    if spec.is_moe:
        from megatron_maspo.model.moe import moe_summary

        print(moe_summary(cfg.model))
    if cfg.rollout.disaggregated:
        return _run_disaggregated(cfg, spec, args, hw)
    plan = estimate(cfg, spec, layout_of(cfg), nodes=args.nodes, gpus_per_node=args.gpus_per_node, hw=hw)
    print(format_plan(plan, "recipe layout: "))
    _print_comparison(cfg, spec, args, hw)
    if plan.fits:
        return 0
    from megatron_maspo.launch.plan.verdict import memory_verdicts

    for verdict in memory_verdicts(cfg, spec, plan, nodes=args.nodes, gpus_per_node=args.gpus_per_node, hw=hw):
        print(f"memory verdict: {verdict.describe()}")
    better = suggest(cfg, spec, nodes=args.nodes, gpus_per_node=args.gpus_per_node, hw=hw)
    if better is None:
        print("no layout over tp/pp/ep/recompute/distributed-optimizer/vllm_tp fits: add nodes or shorten "
              "sequences (rollout.max_new_tokens, train.max_tokens_per_micro_batch)")
    else:
        print(format_plan(better, "nearest fitting layout: "))
        print("  use: " + " ".join(f"--set {o}" for o in apply_layout(cfg, better.layout)))
    return 1


def _print_comparison(cfg, spec, args, hw) -> None:
    """The colocated step beside the best disaggregated split of the same GPUs (``--splits``: all)."""
    from megatron_maspo.launch.plan.estimator import layout_of
    from megatron_maspo.launch.plan.report import format_comparison
    from megatron_maspo.launch.plan.split import compare_placements

    if args.nodes * args.gpus_per_node < 2:
        return
    cmp = compare_placements(cfg, spec, layout_of(cfg), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             hw=hw, staleness=args.staleness)
    print(format_comparison(cmp, table=args.splits))


def _run_disaggregated(cfg, spec, args, hw) -> int:
    """``rollout.placement=disaggregated``: the split's two pools, its memory verdicts, the comparison."""
    from megatron_maspo.launch.plan.disagg import POOL_CHANGES, estimate_disaggregated
    from megatron_maspo.launch.plan.estimator import layout_of
    from megatron_maspo.launch.plan.report import format_pool_plan
    from megatron_maspo.launch.plan.verdict import memory_verdicts

    plan = estimate_disaggregated(cfg, spec, layout_of(cfg), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                  hw=hw)
    print(format_pool_plan(plan, "recipe layout, disaggregated: "))
    _print_comparison(cfg, spec, args, hw)
    if plan.fits:
        return 0
    for verdict in memory_verdicts(cfg, spec, plan, nodes=args.nodes, gpus_per_node=args.gpus_per_node, hw=hw,
                                   estimator=estimate_disaggregated, changes=POOL_CHANGES):
        print(f"memory verdict: {verdict.describe()}")
    return 1
