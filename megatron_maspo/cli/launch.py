"""``maspo launch``: run a recipe under torchrun through NeMo-Run, on this machine or on a Slurm cluster.

The recipe (+ ``--set`` overrides) is resolved, its ``parallel.world_size`` set to nodes x GPUs per node,
and written to ``<job-dir>/<name>/config.yaml``; the job runs ``torchrun ... -m megatron_maspo.cli.main
train --config <that file>`` on every node. ``--dry-run`` prints the resolved config and the job script
(the sbatch script on Slurm) and submits nothing. Needs the ``launch`` extra.

    # workstation, 8 GPUs
    maspo launch r1_distill_qwen_1p5b_maspo --executor local --gpus-per-node 8
    # Slurm, 4 nodes x 8 GPUs, pyxis container, shared filesystem for the job folder
    maspo launch r1_distill_qwen_7b_maspo --executor slurm --nodes 4 --account ACC --partition batch \\
        --time 24:00:00 --container-image nvcr.io/nvidia/pytorch:25.04-py3 \\
        --mount /lustre/models:/models --mount /lustre/data:/data --job-dir /lustre/$USER/maspo \\
        --env NCCL_IB_HCA=mlx5_0,mlx5_1 --dry-run
    # a real Slurm job on the one-node cluster of scripts/slurm_local.sh (CPU, 2 ranks)
    maspo launch tiny --executor slurm --account local --partition local --gpus-per-node 2 --cpu \\
        --launcher srun --job-dir runs/slurm --name tiny-dp2 --set train.steps=4
    maspo launch --status --name tiny-dp2 --job-dir runs/slurm        # --logs: every attempt's log
    # CPU smoke test of the launcher (2 gloo ranks)
    maspo launch tiny --executor local --gpus-per-node 2 --set train.steps=1 --env OMP_NUM_THREADS=1
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_maspo.cli.common import add_config_args

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run a recipe under torchrun via NeMo-Run (local or Slurm)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe_name", nargs="?", default=None, metavar="RECIPE", help="recipe (as --recipe)")
    add_config_args(p)
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="processes per node (default: 8 on Slurm; local: visible GPUs, else 1)")
    p.add_argument("--name", default=None, help="job name (default: the run directory's name)")
    p.add_argument("--job-dir", default="runs/launch",
                   help="folder for the resolved config and job files (Slurm: a shared filesystem path)")
    p.add_argument("--account", default=None, help="Slurm account")
    p.add_argument("--partition", default=None, help="Slurm partition")
    p.add_argument("--time", default="04:00:00", help="Slurm time limit (default 04:00:00)")
    p.add_argument("--container-image", default=None, help="container image for srun (pyxis/enroot)")
    p.add_argument("--mount", dest="mounts", action="append", default=[], metavar="SRC:DST",
                   help="container mount (repeatable)")
    p.add_argument("--env", dest="env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the job; overrides the NCCL/IB defaults (repeatable)")
    p.add_argument("--master-port", type=int, default=29500, help="torchrun rendezvous port (default 29500)")
    p.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                   help="Slurm: torchrun per node (default), or one srun task per rank (each rank gets "
                        "Slurm's signals itself)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU-only nodes: request no GPUs, no CUDA environment (gloo)")
    p.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="Slurm: SIGUSR1 this long before the time limit; the trainer checkpoints and "
                        "requeues the job (default 300; 0: none)")
    p.add_argument("--status", action="store_true",
                   help="Slurm: state of the job last submitted as --name under --job-dir, then exit")
    p.add_argument("--logs", action="store_true",
                   help="Slurm: print that job's log (all attempts), then exit")
    p.add_argument("--module", default=None,
                   help="advanced: run `python -m MODULE --config FILE` instead of `maspo train` "
                        "(e.g. a smoke-test entry point)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and job script only")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_maspo.cli.common import config_from_args
    from megatron_maspo.config import dump_yaml
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.launch.job import (
        TRAIN_MODULE,
        LaunchOptions,
        parse_env,
        resolve_for_cluster,
        train_args,
        write_config,
    )

    if args.status or args.logs:
        return _show(args)
    if args.recipe_name:
        if args.recipe:
            raise ConfigError("give the recipe either positionally or with --recipe, not both")
        args.recipe = args.recipe_name
    cuda = _cuda_available()
    gpus = args.gpus_per_node or (8 if args.executor == "slurm" else max(1, _cuda_count()))
    # The launcher owns the world size: set it first so --set parallel.tp=... validates against it.
    args.overrides = [f"parallel.world_size={args.nodes * gpus}", *args.overrides]
    cfg = config_from_args(args)
    try:  # the launch flags, validated by LaunchOptions and the cluster resolution
        opts = LaunchOptions(executor=args.executor, name=args.name or Path(cfg.checkpoint.run_dir).name,
                             nodes=args.nodes, gpus_per_node=gpus, job_dir=args.job_dir, account=args.account,
                             partition=args.partition, time=args.time, container_image=args.container_image,
                             container_mounts=args.mounts, env=parse_env(args.env),
                             master_port=args.master_port, launcher=args.launcher, cpu=args.cpu,
                             signal_lead_s=args.signal_lead)
        cfg = resolve_for_cluster(cfg, opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _warn_if_not_fitting(cfg, opts)
    if opts.executor == "local" and opts.nodes == 1 and not args.dry_run:
        _check_port_free(opts.master_port)
    config_path = write_config(cfg, opts)
    if args.module:
        module, task_args = args.module, ["--config", str(config_path)]
    else:
        module, task_args = TRAIN_MODULE, train_args(config_path)

    # The only place the launcher touches nemo_run (a missing extra fails here with the install hint).
    try:
        from megatron_maspo.launch import nemo_run as nr
    except ImportError as e:
        print(f"maspo launch: error: {e}", file=sys.stderr)
        return 2

    task = nr.build_task(task_args, module=module)
    use_cuda = (cuda or args.executor == "slurm") and not args.cpu
    if args.dry_run:
        sys.stdout.write(f"# resolved config ({config_path})\n{dump_yaml(cfg)}\n")
        sys.stdout.write(f"# job script ({args.executor}, not submitted)\n")
        sys.stdout.write(nr.dry_run_script(opts, task, cuda=use_cuda) + "\n")
        return 0
    try:
        record = nr.launch(opts, task, cuda=use_cuda, run_dir=cfg.checkpoint.run_dir)
    except RuntimeError as e:
        print(f"maspo launch: {e}", file=sys.stderr)
        return 1
    if record is not None:
        print(f"submitted Slurm job {record.job_id}: log {record.log}; run directory {cfg.checkpoint.run_dir}\n"
              f"  maspo launch --status --name {opts.name} --job-dir {args.job_dir}   (--logs for the log)")
    return 0


def _check_port_free(port: int) -> None:
    """torchrun's rendezvous binds ``port`` on this host; one in use ends in torchrun's 40-line
    ``DistNetworkError: ... EADDRINUSE`` traceback. Say it in one line before anything starts."""
    import errno
    import socket

    from megatron_maspo.errors import ConfigError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))  # torchrun's c10d store listens on every interface
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--master-port {port} is in use on this host (another job's rendezvous?); "
                                  "pass a free one, e.g. --master-port 29501") from None
            raise


def _show(args: argparse.Namespace) -> int:
    """``--status`` / ``--logs`` of the job recorded under ``<job-dir>/<name>``."""
    from pathlib import Path

    from megatron_maspo.errors import ConfigError
    from megatron_maspo.launch.slurm_job import job_state, read_record

    if not args.name:
        raise ConfigError("--status/--logs need --name (and --job-dir if not the default)")
    record = read_record((Path(args.job_dir) / args.name).resolve())
    if args.logs:
        sys.stdout.write(record.read_log())
        return 0
    state = job_state(record.job_id)
    print(f"job {record.job_id} ({args.name}): {state.describe()}\nlog: {record.log}\nrun directory: "
          f"{record.run_dir}")
    return 0


def _warn_if_not_fitting(cfg, opts) -> None:
    """Run the planner when the architecture is known here; warn (not refuse) if it predicts no fit."""
    from megatron_maspo.launch.plan.estimator import arch_of, estimate, layout_of

    if opts.executor != "slurm":
        return
    try:
        spec = arch_of(cfg)
    except ValueError:
        return
    if cfg.rollout.disaggregated:  # two pools, no GPU shared (launch/plan/disagg.py)
        from megatron_maspo.launch.plan.disagg import estimate_disaggregated as estimate
    plan = estimate(cfg, spec, layout_of(cfg), nodes=opts.nodes, gpus_per_node=opts.gpus_per_node)
    for reason in plan.reasons:
        logger.warning("planner (80 GiB GPUs assumed): %s -- see `maspo plan`", reason)


def _cuda_available() -> bool:
    from megatron_maspo.parallel.device import on_cuda  # torch: not for `maspo --help`

    return on_cuda()


def _cuda_count() -> int:
    import torch

    from megatron_maspo.parallel.device import on_cuda

    return torch.cuda.device_count() if on_cuda() else 0
