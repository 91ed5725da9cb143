"""``maspo train``: run or resume RL training (see megatron_maspo/train/loop.py for the loop).

    maspo train                                      # the tiny recipe on CPU (~5 min on 2 cores)
    maspo train --set loss.method=grpo --set train.seed=2
    maspo train --resume runs/maspo                  # continue from the last checkpoint
    torchrun --nproc-per-node 8 -m megatron_maspo.cli.main train --recipe r1_distill_qwen_7b_maspo
"""

from __future__ import annotations

import argparse
import os

from megatron_maspo.cli.common import add_config_args, config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run or resume RL training",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="resume the run in RUN_DIR from its last checkpoint (uses RUN_DIR/config.yaml "
                        "unless --recipe/--config is given)")
    p.set_defaults(run=run)


def _check_prompts(cfg) -> None:
    """No usable prompt (none loads, or none fits ``data.max_prompt_tokens``) fails here, in one line,
    with the tokenizer only: before any model is built and before the run directory is created."""
    from megatron_maspo.data.dataset import load_examples, tokenize_examples
    from megatron_maspo.data.example import SkipLog
    from megatron_maspo.errors import InputError

    class _Counted(SkipLog):  # the trainer logs each skip reason once when it loads the data itself
        def skip(self, reason: str, where: str) -> None:
            self.counts[reason] += 1

    skips = _Counted()
    examples = load_examples(cfg.data, skips)
    tok = _tokenizer(cfg.model.source)
    if examples and tok is not None:
        examples = tokenize_examples(examples, tok, cfg.data, skips)
    if not examples:
        budget = (f"; every prompt is over data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
                  if set(skips.counts) == {"too_long"} else "")
        raise InputError(f"data.source={cfg.data.source!r}: no usable row (skipped: {dict(skips.counts)}){budget}")


def _screen_inputs(cfg, resume_from) -> None:
    """Every checkpoint this run will load, screened before any model is built (``docs/security.md``):
    the one ``--resume`` continues from and ``model.megatron_checkpoint``. The loads screen again."""
    from pathlib import Path

    from megatron_maspo.model.safe_load import screen_checkpoint

    for ckpt in (resume_from, cfg.model.megatron_checkpoint):
        if ckpt is not None and Path(ckpt).is_dir():
            screen_checkpoint(Path(ckpt))


def job_rank() -> int:
    """This process's global rank before any process group exists: torchrun's ``RANK``, an srun-native
    task's ``SLURM_PROCID`` (``MASPO_RANKS_FROM_SLURM=1``), else 0 (one process). One lock per job
    depends on it: with every task taking itself for rank 0, all but one would be refused."""
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.train.process.distributed import rank_env_from_slurm

    try:
        env = {**os.environ, **rank_env_from_slurm(dict(os.environ))}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return int(env.get("RANK", "0"))


def _tokenizer(source: str):
    """The run's tokenizer without its model: the byte tokenizer, or an HF folder's; None otherwise (the
    model build reports a bad source)."""
    from pathlib import Path

    if source == "tiny":
        from megatron_maspo.data.tokenizer import build_byte_tokenizer

        return build_byte_tokenizer()
    if (Path(source) / "config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    return None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_maspo.errors import MissingPathError

    if args.resume:
        if not Path(args.resume).is_dir():
            raise MissingPathError(f"--resume {args.resume}: no such run directory")
        if not (args.recipe or args.config):
            if not (Path(args.resume) / "config.yaml").is_file():
                raise MissingPathError(f"--resume {args.resume}: no config.yaml in it (not a run directory "
                                       "written by maspo train?); pass --recipe or --config as well")
            args.config = args.resume
    from megatron_maspo.cli.common import launcher_overrides

    args.overrides = launcher_overrides(args.overrides, dict(os.environ))
    cfg = config_from_args(args)
    if args.resume:
        from dataclasses import replace

        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, run_dir=args.resume))
    # Fail on bad input before any heavy work: data files must exist, user hooks must import, the run
    # directory must fit --resume.
    from megatron_maspo.plugins import announce_plugins, is_target, resolve

    if args.config:  # a saved config (a run directory perhaps from elsewhere): say what it will import
        announce_plugins(cfg, f"config {args.config}")
    src = cfg.data.source
    if is_target(src) and not Path(src).exists() and not src.startswith("reasoning_gym:"):
        resolve(src, "data.source")  # user hooks: import errors name the field, before any heavy work
    elif src != "synthetic" and not src.startswith("reasoning_gym:") and not Path(src).exists():
        raise MissingPathError(f"data.source={src!r}: no such file")
    if cfg.reward.grader:
        resolve(cfg.reward.grader, "reward.grader")
    if not src.startswith("reasoning_gym:"):  # reasoning-gym generates its rows in the trainer
        _check_prompts(cfg)
    from megatron_maspo.launch.requeue import auto_resume, requeue_if_unfinished
    from megatron_maspo.train.preflight import check_layout_supported, check_run_dir

    check_layout_supported(cfg.parallel, cfg.model, cfg.loss)
    from megatron_maspo.stack import refuse_broken_stack

    refuse_broken_stack()  # on a GPU: a known-broken torch/vLLM/TE set stops here, in one line
    resume = bool(args.resume) or auto_resume(cfg)
    from megatron_maspo.train.process.run_lock import run_dir_lock

    # The run directory is this run's before anything is written there (train/process/run_lock.py).
    with run_dir_lock(cfg.checkpoint.run_dir, rank=job_rank()):
        ckpts = check_run_dir(cfg.checkpoint.run_dir, resume=resume)
        if resume:  # a model or layout the checkpoint cannot follow: one line, before Megatron sees it
            from megatron_maspo.train.process.resume_check import check_resume_config

            check_resume_config(cfg.checkpoint.run_dir, cfg, ckpts[-1])
        if job_rank() == 0:  # the other ranks' loads get rank 0's verdict (screen_checkpoint_once)
            _screen_inputs(cfg, ckpts[-1] if resume else None)
        from megatron_maspo.model.ckpt_manifest import check_storage
        from megatron_maspo.train.preflight import free_bytes_needed

        # Writable, with room for the next checkpoint (checkpoint.min_free_mb; by default one checkpoint).
        check_storage(cfg.checkpoint.run_dir, free_bytes_needed(cfg, ckpts))

        import time

        t0 = time.monotonic()
        from megatron_maspo.parallel.device import import_megatron_core

        import_megatron_core()  # megatron-core from here on
        from megatron_maspo.train.loop import train

        run_dir = train(cfg, resume=resume)
    requeue_if_unfinished(cfg)  # a Slurm job stopped by its time-limit signal goes back in the queue
    print(f"run directory: {run_dir}")
    if job_rank() == 0:
        from megatron_maspo.cli.summary import run_summary

        print("\n".join(run_summary(run_dir, time.monotonic() - t0)))
    return 0
