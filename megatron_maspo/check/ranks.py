"""Build every distinct model-parallel rank of a check on the meta device, in worker processes when many.

A 512-GPU DeepSeek-V3 layout (TP 8 x EP 256) has 256 distinct ranks at about a second each (the Megatron
build, then the conversion tables under both specs' names); split over the machine's cores the whole check
stays within minutes. Each worker is a fresh interpreter (``spawn``: a fork would copy the parent's OpenMP
and fake-process-group state) that rebuilds the options from the config and checks its share of the
coordinates; the parent merges the shares in rank order, so the report is the same as in one process.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass, field

from megatron_maspo.check.steps import RankCounts

IN_PROCESS_MAX = 32
"""Up to this many distinct ranks the check builds them in its own process (starting workers costs more)."""


@dataclass
class RanksResult:
    """What the ranks' builds found, merged over workers in rank order."""

    n_local: int = 0
    n_te: int = 0
    counts: list[RankCounts] = field(default_factory=list)
    shards: list[tuple] = field(default_factory=list)
    stages: dict[int, dict] = field(default_factory=dict)

    def merge(self, other: RanksResult) -> None:
        self.n_local += other.n_local
        self.n_te += other.n_te
        self.counts += other.counts
        self.shards += other.shards
        self.stages.update(other.stages)


def build_options(cfg, spec):
    """The trainer's ``ModelBuildOptions`` for ``cfg`` (``train/actor/inference.actor_build_options``), on the
    meta device; with the TE backend the local spec stands in (names renamed later). Returns (opts, te,
    grouped)."""
    from megatron_maspo.model.provider import moe_grouped_gemm
    from megatron_maspo.train.actor.inference import actor_build_options

    te = cfg.model.attention_backend == "te"
    built = cfg if not te else dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                 attention_backend="packed_sdpa"))
    opts = dataclasses.replace(actor_build_options(built.model, built.parallel, spec), use_cpu_initialization=False)
    grouped = moe_grouped_gemm(dataclasses.replace(opts, use_te=True))
    return opts, te, grouped


def check_ranks(cfg, spec, coords: list, world: int) -> RanksResult:
    """Build each coordinate of ``coords`` (of a ``world``-rank job) and run the per-rank steps on it."""
    from megatron_maspo.check.steps import check_names, rank_counts, sharded_shards, stage_manifest
    from megatron_maspo.check.world import build_meta_chunks, fake_rank

    p = cfg.parallel
    opts, te, grouped = build_options(cfg, spec)
    vocab_rows = spec.padded_vocab_size(p.tp, cfg.model.make_vocab_size_divisible_by)
    out = RanksResult()
    for c in coords:
        where = f"rank {c.rank} (tp {c.tp}, pp {c.pp}, ep {c.ep}, cp {c.cp})"
        kw = dict(tp=p.tp, ep=p.ep, ep_rank=c.ep, vocab_rows=vocab_rows, where=where)
        with fake_rank(world, c, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, vpp=p.vpp):
            chunks = build_meta_chunks(spec, opts, c.pp)
            if not te:
                out.n_local += check_names(chunks, spec, **kw)
            out.n_te += check_names(chunks, spec, te=True, grouped=grouped, **kw)
            out.counts.append(rank_counts(chunks))
            out.stages[c.pp] = stage_manifest(chunks)  # identical for every rank of one stage
            out.shards += list(sharded_shards(chunks))  # needs the rank's parallel state (its DP group)
        del chunks
        gc.collect()
    return out


def _worker(cfg, coords: list, world: int) -> RanksResult:
    import logging
    import warnings

    from megatron_maspo.launch.plan.estimator import arch_of

    warnings.simplefilter("ignore")  # the parent already printed Megatron's import-time warnings
    logging.disable(logging.WARNING)
    return check_ranks(cfg, arch_of(cfg), coords, world)


def default_jobs() -> int:
    """Worker processes: the cores this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def check_all_ranks(cfg, spec, coords: list, world: int, jobs: int | None = None) -> RanksResult:
    """:func:`check_ranks` over ``coords``, split round-robin over ``jobs`` spawned workers when there are
    more than :data:`IN_PROCESS_MAX` coordinates; a worker's :class:`CheckError` is raised here."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 2 or len(coords) <= IN_PROCESS_MAX:
        return check_ranks(cfg, spec, coords, world)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    shares = [coords[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        parts = [r.result() for r in [pool.submit(_worker, cfg, share, world) for share in shares]]
    # back to rank order: worker i holds coordinates i, i + jobs, ... (shards and counts are per rank)
    out = RanksResult()
    for part in parts:
        out.merge(part)
    order = [c for share in shares for c in share]
    by_rank = dict(zip([c.rank for c in order], out.counts))
    out.counts = [by_rank[c.rank] for c in coords]
    return out
