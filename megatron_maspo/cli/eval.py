"""``maspo eval``: Avg@k and unbiased Pass@k of a trained checkpoint, through the rollout engine.

    maspo eval runs/tiny                                  # a fresh synthetic draw, k=8
    maspo eval runs/qwen7b --data aime24.jsonl --data math500.jsonl --k 32 --max-new-tokens 8192
    torchrun --nproc-per-node 8 -m megatron_maspo.cli.main eval runs/qwen7b --data aime24.jsonl

Loads the run's config.yaml, builds an inference-only policy (no gradient buffers, optimizer or fp32
master copy) at the run's layout, loads the latest (or the given)
checkpoint, syncs it into the engine and samples k responses per problem. Benchmark files are local
files in any format the data loaders read (AIME / AMC / MATH500 / Minerva / OlympiadBench field names
are detected). Without ``--data`` a fresh draw of the run's synthetic task (another seed) is used; for
the single-digit task that draw overlaps the training problems (there are only 100 distinct sums).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from megatron_maspo.errors import ConfigError, MissingPathError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="Avg@k / Pass@k of a checkpoint", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory (holds config.yaml and checkpoints/)")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the latest)")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="benchmark file (jsonl/json/parquet); repeatable; default: a fresh synthetic draw")
    p.add_argument("--k", type=int, default=8, help="samples per problem (default 8)")
    p.add_argument("--temperature", type=float, default=None, help="default: the run's rollout temperature")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's max_new_tokens")
    p.add_argument("--num-problems", type=int, default=64, help="synthetic problems drawn (default 64)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the run's config")
    p.set_defaults(run=run)


def _datasets(cfg, args, tokenizer) -> dict:
    from megatron_maspo.data.config import DataConfig
    from megatron_maspo.data.dataset import build_prompt_dataset

    if not args.data:
        redraw = dataclasses.replace(cfg.data, num_examples=args.num_problems, seed=cfg.data.seed + 10_007)
        return {"synthetic_redraw": build_prompt_dataset(redraw, tokenizer)[0]}
    out = {}
    for f in args.data:
        if not Path(f).exists():
            raise MissingPathError(f"--data {f}: no such file")
        dc = DataConfig(source=f, format="eval", apply_chat_template=cfg.data.apply_chat_template,
                        system_prompt=cfg.data.system_prompt, max_prompt_tokens=cfg.data.max_prompt_tokens)
        out[Path(f).stem] = build_prompt_dataset(dc, tokenizer)[0]
    return out


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.config import resolve_config
    from megatron_maspo.train.checkpoint import list_checkpoints
    from megatron_maspo.train.loop import CHECKPOINT_SUBDIR

    cfg = resolve_config(None, args.run_dir, args.overrides)
    if args.k < 1:
        raise ConfigError(f"--k must be >= 1, got {args.k}")
    for f in args.data:
        if not Path(f).exists():
            raise MissingPathError(f"--data {f}: no such file")
    ckpts = list_checkpoints(Path(args.run_dir) / CHECKPOINT_SUBDIR)
    ckpt = args.checkpoint or (ckpts[-1] if ckpts else None)
    if ckpt is None or not Path(ckpt).is_dir():  # before building anything
        raise MissingPathError(f"no checkpoint {ckpt or 'under ' + str(Path(args.run_dir) / CHECKPOINT_SUBDIR)}")

    from megatron_maspo.parallel.groups import destroy_parallel, init_parallel
    from megatron_maspo.reward.math_reward import MathReward
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb, sync_weights
    from megatron_maspo.train.checkpoint import load_checkpoint
    from megatron_maspo.train.components import build_engine, build_policy_source
    from megatron_maspo.train.distributed import setup_distributed
    from megatron_maspo.train.inference import InferencePolicy

    rank, world = setup_distributed()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=world))
    p = cfg.parallel
    groups = init_parallel(tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, seed=cfg.train.seed)
    try:
        tok, spec, init = build_policy_source(cfg, groups)
        # weights only: no DDP gradient buffer, no optimizer, no fp32 master copy
        actor = InferencePolicy(cfg, spec, groups, init_weights=init)
        load_checkpoint(actor, ckpt, load_optimizer=False)
        engine = build_engine(cfg, spec, tok) if rank == 0 else None
        sync_weights(actor.named_modules_unwrapped(), spec, groups, engine,
                     bucket_bytes=bucket_bytes_from_mb(cfg.rollout.bucket_mb),
                     verify_checksums=cfg.rollout.verify_checksums)
        if rank != 0:
            return 0
        datasets = _datasets(cfg, args, tok)
        params = SamplingParams(n=args.k, temperature=args.temperature or cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p,
                                max_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens,
                                stop_token_ids=[tok.eos_token_id], seed=cfg.train.seed)
        from megatron_maspo.eval.runner import evaluate

        with MathReward(cfg.reward) as grader:
            report = evaluate(engine, datasets, k=args.k, sampling=params, grader=grader, tokenizer=tok)
        print(f"checkpoint: {ckpt}")
        print(report.table())
        if args.json:
            Path(args.json).write_text(report.to_json())
        return 0
    finally:
        destroy_parallel()
