"""A staged sync on an engine owner: every sender's buckets of one version, checked and put in export order.

An owner of the rollout pool receives one sync over several links at once (``pool_sync.WeightReceiver``:
one link per sender, ``rollout.sync_senders=stages``). Link j carries only sender j's tensors, in the
export's global order restricted to that sender, so the links concatenated are in *link* order: for a MoE
model link 0 holds the dense tensors (and EP rank 0's experts) of every layer of the stage, link 1 EP
rank 1's experts of every layer, and so on. A FusedMoE layer of vLLM is then complete only after the last
link, and vLLM's layer-wise reload keeps every tensor of an incomplete layer on the device meanwhile
((ep-1)/ep of the stage's expert bytes per worker). :func:`in_export_order` hands the engine the same
bytes in the plan's global order (``transfer_plan.TransferPlan.sends``: layer by layer) without copying:

    staged buckets  link 0: [b0: L0 attn, L0 experts 0-1] [b1: L1 attn ...]   link 1: [b0': L0 experts 2-3] ...
    runs            [b0: L0 attn, L0 experts 0-1] [b0': L0 experts 2-3] [b1: L1 attn ...] ...

A run is a :class:`~.buckets.Bucket` viewing a contiguous slice of one staged buffer (metadata rebased,
no checksum: :func:`check_complete` verified the buffer), so a transport maps or sends only the run's
bytes. A split tensor's pieces come from one sender in order, so they stay consecutive and reassemble
(``buckets.Reassembler``). A staged buffer goes back to its pool once every run cut from it is done.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

from megatron_maspo.rollout.buckets import Bucket, checksum

logger = logging.getLogger(__name__)


def check_complete(staged: list[Bucket]) -> None:
    """Before a staged sync may be activated: every bucket's crc32 matches (host buffers; device buffers
    carry none) and every tensor's bytes arrived whole (each split tensor's pieces tile it in order).
    A bucket whose crc32 matched has its ``checksum`` cleared: the engine need not compute it again.

    Raises:
        ValueError: naming the bucket or the tensor; the sync is then never handed to the engine.
    """
    got: dict[str, int] = {}
    for b in staged:
        if b.checksum is not None and not b.buffer.is_cuda:
            crc = checksum(b.buffer)
            if crc != b.checksum:
                raise ValueError(f"weight-sync bucket {b.index} arrived corrupted: crc32 {crc:#010x} != sent "
                                 f"{b.checksum:#010x}; the staged version is discarded")
            b.checksum = None
        for m in b.metas:
            if m.offset + m.span > b.buffer.numel():
                raise ValueError(f"tensor {m.name!r} spans beyond bucket {b.index} ({b.buffer.numel()} bytes)")
            start = 0 if m.part is None else m.part[0]
            if got.get(m.name, 0) != start:
                raise ValueError(f"weight sync: tensor {m.name!r} bytes from {start} arrived after "
                                 f"{got.get(m.name, 0)}; the staged version is discarded")
            got[m.name] = start + m.span
    size = {m.name: m.nbytes for b in staged for m in b.metas}
    short = sorted(n for n, nbytes in size.items() if got[n] != nbytes)
    if short:
        raise ValueError(f"weight sync ended with tensors incomplete: {short[:4]}; the staged version is discarded")


def in_export_order(staged: Sequence[Bucket], order: Mapping[str, int]) -> list[Bucket]:
    """``staged`` (checked, in link order) as runs in the global order ``order`` (HF name -> position).

    Names missing from ``order`` (a receiver whose plan disagrees with its senders') follow the others in
    arrival order, with a warning: the bytes are still right, only vLLM buffers more.
    """
    entries = []  # (position, piece start, arrival, bucket index in staged, meta)
    unknown = []
    for bi, b in enumerate(staged):
        for m in b.metas:
            pos = order.get(m.name)
            if pos is None:
                unknown.append(m.name)
                pos = len(order)
            entries.append((pos, 0 if m.part is None else m.part[0], len(entries), bi, m))
    if unknown:
        logger.warning("weight sync: %d staged tensor(s) not in the transfer plan (e.g. %r): relayed last",
                       len(unknown), unknown[0])
    entries.sort(key=lambda e: e[:3])
    groups: list[tuple[int, list]] = []
    for *_, bi, m in entries:
        if groups and groups[-1][0] == bi:
            groups[-1][1].append(m)
        else:
            groups.append((bi, [m]))
    cuts: dict[int, int] = {}
    for bi, _ in groups:
        cuts[bi] = cuts.get(bi, 0) + 1
    releases = {bi: _after_all(staged[bi], n) for bi, n in cuts.items()}
    return [_run(staged[bi], metas, releases[bi]) for bi, metas in groups]


def _run(src: Bucket, metas: list, release: Callable[[], None]) -> Bucket:
    """A view of ``src.buffer`` from its first to its last meta in ``metas`` (offsets rebased)."""
    lo, hi = metas[0].offset, metas[-1].offset + metas[-1].span  # metas of one bucket keep its byte order
    whole = lo == 0 and hi == src.buffer.numel() and len(metas) == len(src.metas)
    buf = src.buffer if whole else src.buffer[lo:hi]
    names = {m.name for m in metas if m.completes}
    digests = {n: v for n, v in src.digests.items() if n in names} if src.digests else None
    return Bucket(buf, [m if whole else dataclasses.replace(m, offset=m.offset - lo) for m in metas], None,
                  src.index, release, digests or None, src.ready)


def _after_all(src: Bucket, n: int) -> Callable[[], None]:
    """A release for each of ``n`` runs of ``src``: the last one hands ``src``'s buffer back."""
    left = [n]

    def release() -> None:
        left[0] -= 1
        if left[0] == 0:
            src.done()

    return release
