"""``maspo eval``: Avg@k and unbiased Pass@k of a trained checkpoint, through the rollout engine.

    maspo eval runs/tiny                                  # a fresh synthetic draw, Avg@32, Pass@1..32
    maspo eval runs/qwen7b --benchmarks /data/eval --max-new-tokens 8192   # the paper's six benchmarks
    maspo eval runs/qwen7b --data aime24.jsonl --temperature 0          # greedy, one sample
    torchrun --nproc-per-node 8 -m megatron_maspo.cli.main eval runs/qwen7b --data aime24.jsonl

Loads the run's config.yaml, builds an inference-only policy (no gradient buffers, optimizer or fp32
master copy) at the run's layout, loads the latest (or the given)
checkpoint, syncs it into the engine and samples k responses per problem (default 32: the paper's
Avg@32 and Pass@k for k = 1..32; the JSON report has every k). Benchmark files are local files in any
format the data loaders read (AIME / AMC / MATH500 / Minerva / OlympiadBench field names are detected);
``--benchmarks DIR`` finds the six by name (`eval/benchmarks.py`). Prompts get the run's
``data.prompt_template`` (the training prompt); prompts over ``data.max_prompt_tokens`` are counted,
reported and scored wrong (``--dropped exclude`` leaves them out of the denominator instead).
``--temperature 0`` is greedy decoding (k defaults to 1 then). Without ``--data`` a fresh draw of the run's synthetic task (another seed) is used; for
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
    p.add_argument("--benchmarks", default=None, metavar="DIR",
                   help="folder holding AIME24/AIME25/AMC23/MATH500/Minerva/OlympiadBench files (found by name)")
    p.add_argument("--k", type=int, default=None, help="samples per problem (default 32; 1 with --temperature 0)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the run's rollout temperature; 0 = greedy")
    p.add_argument("--grader", choices=("math_verify", "prime_math"), default=None,
                   help="math_verify: the training reward; prime_math: the paper's evaluation grader rules "
                        "(default: the run's eval.grader; the paper recipes set prime_math)")
    p.add_argument("--dropped", choices=("wrong", "exclude"), default="wrong",
                   help="prompts over the length budget: score them wrong (default) or leave them out")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's max_new_tokens")
    p.add_argument("--num-problems", type=int, default=64, help="synthetic problems drawn (default 64)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the run's config")
    p.set_defaults(run=run)


def _datasets(cfg, args, tokenizer) -> tuple[dict, dict]:
    """``({benchmark: examples}, {benchmark: prompts dropped for length})``, with the training prompt."""
    from megatron_maspo.eval.datasets import eval_datasets

    return eval_datasets(cfg.data, tokenizer, files=args.data, benchmarks=args.benchmarks,
                         num_problems=args.num_problems)


def _grader(name: str, cfg):
    """The training reward (math-verify) or the paper's evaluation grader rules (prime_math)."""
    if name == "prime_math":
        from megatron_maspo.reward.prime_grader import prime_math_reward

        return prime_math_reward(cfg.reward)
    from megatron_maspo.reward.math_reward import MathReward

    return MathReward(cfg.reward)


def _pinned(explicit: str | None, root: Path, rank: int, world: int) -> tuple[Path, Path]:
    """Rank 0 picks the checkpoint (the given one, or the newest complete one now), screens it and pins it
    (``model/ckpt_pin.py``); every rank gets the same (checkpoint, snapshot) pair.

    Raises:
        InputError: the screen refused a file (named by its path in the checkpoint).
        MissingPathError: the checkpoint disappeared, or every newest one was pruned before it was pinned.
    """
    from megatron_maspo.errors import InputError
    from megatron_maspo.model.ckpt_manifest import list_checkpoints, usable
    from megatron_maspo.model.ckpt_pin import CheckpointVanished, pin, remove_stale_pins, unpin
    from megatron_maspo.model.safe_load import screen_checkpoint
    from megatron_maspo.parallel import comm

    box: object = None
    if rank == 0:
        remove_stale_pins(root)
        for _ in range(5):  # a trainer pruning between the listing and the links: look again
            found = [Path(explicit)] if explicit else usable(list_checkpoints(root), root)
            if not found:
                box = MissingPathError(f"no checkpoint under {root}")
                break
            try:
                snap = pin(found[-1])
            except CheckpointVanished as e:
                box = MissingPathError(str(e))
                if explicit:
                    break
                continue
            try:
                screen_checkpoint(snap)
            except InputError as e:  # name the file as the user knows it
                unpin(snap)
                box = InputError(str(e).replace(str(snap), str(found[-1])))
                break
            box = (str(found[-1]), str(snap))
            break
    if world > 1:
        box = comm.broadcast_object(box, src=0)
    if isinstance(box, Exception):
        raise box
    ckpt, snap = box  # type: ignore[misc]
    return Path(ckpt), Path(snap)


def _unpin(snap: Path, rank: int, world: int) -> None:
    from megatron_maspo.model.ckpt_pin import unpin
    from megatron_maspo.parallel import comm

    if world > 1:
        comm.barrier()  # every rank has read it
    if rank == 0:
        unpin(snap)


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.model.ckpt_manifest import list_checkpoints
    from megatron_maspo.plugins import announce_plugins
    from megatron_maspo.recipes.registry import resolve_config
    from megatron_maspo.train.config import CHECKPOINT_SUBDIR

    cfg = resolve_config(None, args.run_dir, args.overrides)
    args.grader = args.grader or cfg.eval.grader  # a paper recipe's run grades as the paper did
    announce_plugins(cfg, f"config {args.run_dir}")  # the run's config.yaml: say what it will import
    greedy = args.temperature == 0
    args.k = args.k if args.k is not None else (1 if greedy else 32)
    if args.k < 1:
        raise ConfigError(f"--k must be >= 1, got {args.k}")
    if args.temperature is not None and args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    for f in args.data:
        if not Path(f).exists():
            raise MissingPathError(f"--data {f}: no such file")
    if args.benchmarks:
        from megatron_maspo.eval.benchmarks import find_benchmarks

        find_benchmarks(args.benchmarks)  # fail before building the model
    from megatron_maspo.model.ckpt_manifest import usable

    root = Path(args.run_dir) / CHECKPOINT_SUBDIR
    ckpts = usable(list_checkpoints(root), root)  # a damaged newest checkpoint is named and skipped
    ckpt = args.checkpoint or (ckpts[-1] if ckpts else None)
    if ckpt is None or not Path(ckpt).is_dir():  # before building anything
        raise MissingPathError(f"no checkpoint {ckpt or 'under ' + str(Path(args.run_dir) / CHECKPOINT_SUBDIR)}")

    from megatron_maspo.parallel.device import import_megatron_core

    import_megatron_core()  # megatron-core from here on
    from megatron_maspo.parallel.groups import destroy_parallel, init_parallel
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb, sync_weights
    from megatron_maspo.train.actor.checkpoint import load_checkpoint
    from megatron_maspo.train.components import (
        build_engine,
        build_inference_policy,
        build_policy_source,
    )
    from megatron_maspo.train.process.distributed import setup_distributed

    rank, world = setup_distributed()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=world))
    p = cfg.parallel
    groups = init_parallel(tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, cp=p.cp, seed=cfg.train.seed)
    try:
        # Pinned before the model build: a running run's trainer may prune this checkpoint meanwhile.
        ckpt, snap = _pinned(args.checkpoint, root, rank, world)
        try:
            tok, spec, init = build_policy_source(cfg, groups)
            # weights only: no DDP gradient buffer, no optimizer, no fp32 master copy
            actor = build_inference_policy(cfg, spec, groups, init_weights=init)
            load_checkpoint(actor, snap, load_optimizer=False)
        except BaseException:
            if world == 1:  # several ranks: no collective after an error; the next eval removes it
                _unpin(snap, rank, world)
            raise
        _unpin(snap, rank, world)
        engine = build_engine(cfg, spec) if rank == 0 else None
        sync_weights(actor.named_modules_unwrapped(), spec, groups, engine,
                     bucket_bytes=bucket_bytes_from_mb(cfg.rollout.bucket_mb),
                     verify_checksums=cfg.rollout.verify_checksums)
        if rank != 0:
            return 0
        datasets, dropped = _datasets(cfg, args, tok)
        temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
        params = SamplingParams(n=args.k, temperature=temperature,
                                top_p=cfg.rollout.top_p,
                                max_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens,
                                stop_token_ids=[tok.eos_token_id], seed=cfg.train.seed)
        from megatron_maspo.eval.runner import evaluate

        with _grader(args.grader, cfg) as grader:
            report = evaluate(engine, datasets, k=args.k, sampling=params, grader=grader, tokenizer=tok,
                              dropped=dropped, dropped_as_wrong=args.dropped == "wrong")
        print(f"grader: {args.grader}, temperature: {temperature}, k: {args.k}, "
              f"dropped (over {cfg.data.max_prompt_tokens} prompt tokens): {report.dropped or 0}")
        print(f"checkpoint: {ckpt}")
        print(report.table())
        if args.json:
            Path(args.json).write_text(report.to_json())
        return 0
    finally:
        destroy_parallel()
