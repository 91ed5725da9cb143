"""Flat weight-sync buckets: many named tensors packed into one contiguous uint8 buffer.

One buffer per bucket (not one message per tensor) is what makes a sync cheap: one IPC handle, one
broadcast or one RPC payload per bucket (weight-sync-notes.md §1; vime measured ~4x). The metadata
``{name, dtype, shape, offset}`` travels next to the buffer and lets the receiver rebuild zero-copy views.

A tensor larger than the bucket (the 7B embedding, 152064 x 3584 bf16 = 1,040 MiB, next to the default
512 MiB) is **split along its flat byte range**: each piece is a :class:`TensorMeta` with ``part = (start,
length)`` and rides in its own bucket (the first piece fills what is left of the current one), so a sync
works at any bucket size. The receiver glues the pieces back with a :class:`Reassembler` (one per sync)
and hands the whole tensor on only once every byte arrived, because every receiver (vLLM's
``load_weights`` included) needs the whole tensor at once; pieces arrive in stream order and a gap, an
overlap or a piece left over at the end of the sync raises. :func:`plan_buckets` is the same layout from
``(name, dtype, shape)`` alone (no bytes: ``maspo check`` plans the full-size models with it).

Checksums are ``zlib.crc32`` over the payload bytes: no extra dependency, ~1 GB/s per core, and catches any
torn or stale buffer (the failure mode of SkyRL #1345 that silently fed wrong weights to the engine).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (cache line; keeps any dtype's view aligned)."""

_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool)}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype key (``"bfloat16"`` -> 2)."""
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor (or one piece of it) lives in a bucket buffer."""

    name: str
    """HF checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: str
    """dtype without the ``torch.`` prefix, e.g. ``"float32"`` (plain string: survives any serialiser)."""
    shape: tuple[int, ...]
    """Shape of the WHOLE tensor (also for a piece)."""
    offset: int
    """Byte offset of the first byte in the bucket buffer (a multiple of :data:`ALIGN`)."""
    part: tuple[int, int] | None = None
    """``(start, length)``: this bucket carries bytes ``[start, start + length)`` of the tensor's flat
    bytes; None = the whole tensor."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor: ``prod(shape) * element_size``."""
        n = 1
        for s in self.shape:
            n *= s
        return n * dtype_size(self.dtype)

    @property
    def span(self) -> int:
        """Bytes this meta occupies in its bucket (the piece's length, or :attr:`nbytes`)."""
        return self.nbytes if self.part is None else self.part[1]

    @property
    def completes(self) -> bool:
        """True for a whole tensor or the last piece of a split one (counts each tensor once)."""
        return self.part is None or self.part[0] + self.part[1] == self.nbytes


@dataclass
class Bucket:
    """One packed bucket: ``buffer`` uint8 [nbytes] plus per-tensor metadata and an optional checksum."""

    buffer: torch.Tensor
    metas: list[TensorMeta] = field(default_factory=list)
    checksum: int | None = None
    """``zlib.crc32`` of ``buffer``'s bytes, computed by the sender; ``None`` when checksums are off."""
    index: int = 0
    """Position of this bucket in the sync (0, 1, ...); lets a receiver name the bad bucket."""
    release: Callable[[], None] | None = None
    """Hands a pooled buffer back for the next bucket (``transport.BucketPool``); the consumer calls it
    once nothing reads ``buffer`` any more. None: a buffer of its own, nothing to do."""
    digests: dict[str, list[int]] | None = None
    """``{hf_name: [stride, phase, digest]}`` of the exported tensors this bucket completes
    (:mod:`~.digest`; the engine checks what it holds against them); None when the sync is not verified."""
    ready: Any = None
    """An event recorded on the packing stream after the pack (``parallel/streams.py``): a reader on
    another stream waits for it before reading :attr:`buffer`; None when the pack has completed already
    (host buffers, or a pool that syncs the host: :func:`pack_buckets`)."""

    def done(self, after: Any = None) -> None:
        """Call :attr:`release` once (no-op for unpooled buckets). ``after``: an event of the last read of
        :attr:`buffer` still in flight (a send on another stream); the pool's next user of the buffer
        waits for it (``transport.BucketPool``)."""
        if self.release is not None:
            rel, self.release = self.release, None
            rel() if after is None else rel(after)


def checksum(buffer: torch.Tensor) -> int:
    """``zlib.crc32`` of a contiguous CPU uint8 buffer's bytes (zero-copy through numpy)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError(f"checksum expects a 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
    return zlib.crc32(buffer.detach().cpu().contiguous().numpy())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def min_bucket_mb(nbytes: int) -> int:
    """The smallest whole ``rollout.bucket_mb`` (MiB) whose bucket holds a tensor of ``nbytes`` bytes
    unsplit (whole MiB: ``int(mb * 2**20)`` is then exact, where a rounded decimal is not)."""
    return max(1, -(-nbytes // 2**20))


def _layout(entries: Iterable[tuple[str, str, tuple[int, ...], Any]], bucket_bytes: int,
            ) -> Iterator[tuple[list[tuple[TensorMeta, Any]], int]]:
    """The one layout rule, for bytes and for shapes alike: ``(name, dtype, shape, payload)`` ->
    ``([(meta, payload), ...], used_bytes)`` per bucket.

    A tensor that fits in a fresh bucket is never split (it starts a new bucket when the current one is
    too full); a larger one fills the current bucket's room and continues in the next ones, each piece at
    most ``bucket_bytes``. Offsets are :data:`ALIGN`-aligned; ``used_bytes <= bucket_bytes``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[TensorMeta, Any]] = []
    used, seen = 0, set()
    for name, key, shape, payload in entries:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight stream (tied weights sent twice?)")
        seen.add(name)
        nbytes = TensorMeta(name, key, shape, 0).nbytes
        start = 0
        while True:
            off = _aligned(used) if pending else 0
            room, rest = bucket_bytes - off, nbytes - start
            if rest <= room:
                part = None if start == 0 else (start, rest)
                pending.append((TensorMeta(name, key, shape, off, part), payload))
                used = off + rest
                break
            if pending and (start == 0 and nbytes <= bucket_bytes or room <= 0):
                yield pending, used  # fits a fresh bucket whole (or no room left): do not split here
                pending, used = [], 0
                continue
            pending.append((TensorMeta(name, key, shape, off, (start, room)), payload))
            yield pending, off + room
            pending, used, start = [], 0, start + room
    if pending:
        yield pending, used


def plan_buckets(entries: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int,
                 ) -> Iterator[list[TensorMeta]]:
    """The bucket layout :func:`pack_buckets` would produce for ``(name, dtype, shape)`` entries, without
    any tensor bytes (full-size models on the meta device)."""
    for metas, _ in _layout(((n, d, tuple(s), None) for n, d, s in entries), bucket_bytes):
        yield [m for m, _ in metas]


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *,
                 with_checksum: bool = True, dtype: torch.dtype | None = None,
                 alloc: Any = None, digests: Callable[[int], Any] | None = None) -> Iterator[Bucket]:
    """Stream ``(name, tensor)`` pairs into flat buckets of at most ``bucket_bytes`` bytes.

    The buffer is allocated per bucket at its exact used size (no plan is cached across calls: every sync
    re-derives names, shapes and offsets from the tensors it actually sees, weight-sync-notes.md §1).
    A tensor larger than a bucket is split across buckets (module docstring).

    Args:
        named_tensors: full HF-named tensors (any dtype in the supported set), consumed lazily.
        bucket_bytes: capacity of one bucket in bytes.
        with_checksum: compute ``Bucket.checksum``.
        dtype: cast floating tensors to this dtype before packing (the rollout dtype), else keep.
        alloc: a ``transport.BucketPool`` to pack into (its buffers are reused: each bucket's ``release``
            hands its buffer back); None = a fresh CPU buffer per bucket. A pool with ``events`` set gets
            each bucket with a ``ready`` event instead of a host sync of the packing stream.
        digests: ``nblocks -> digest.Spec`` for this sync (``digest.plan``): each tensor is digested as
            exported (after the cast, on its own device) and the digest rides in ``Bucket.digests`` of
            the bucket that completes it; None = no digests.

    Yields:
        Buckets in stream order; every name appears whole in one bucket or as consecutive pieces.

    Raises:
        ValueError: a name repeats, or ``bucket_bytes`` <= 0.
        TypeError: a tensor's dtype has no entry in the supported set.
    """
    digested: dict[str, tuple[Any, torch.Tensor]] = {}  # name -> (spec, device digest) until flushed

    def entries() -> Iterator[tuple[str, str, tuple[int, ...], torch.Tensor]]:
        for name, t in named_tensors:
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            key = str(t.dtype).removeprefix("torch.")
            if key not in _DTYPES:
                raise TypeError(f"tensor {name!r} has dtype {t.dtype}; supported: {sorted(_DTYPES)}")
            if digests is not None:
                from megatron_maspo.rollout import digest

                spec = digests(digest.num_blocks(digest.words(t).numel()))
                digested[name] = (spec, digest.digest(t, spec))
            yield name, key, tuple(t.shape), t

    for index, (pending, used) in enumerate(_layout(entries(), bucket_bytes)):
        yield _flush(pending, used, index, with_checksum, alloc, digested if digests is not None else None)


def _flush(pending: list[tuple[TensorMeta, torch.Tensor]], used: int, index: int, with_checksum: bool,
           alloc: Any = None, digested: dict | None = None) -> Bucket:
    buf = torch.empty(used, dtype=torch.uint8) if alloc is None else alloc.alloc(used)
    end = 0
    for meta, t in pending:
        buf[end:meta.offset].zero_()  # alignment gaps: deterministic bytes for the crc
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if meta.part is not None:
            flat = flat[meta.part[0]:meta.part[0] + meta.part[1]]
        buf[meta.offset:meta.offset + flat.numel()].copy_(flat, non_blocking=buf.is_cuda)
        end = meta.offset + flat.numel()
    ready = None
    if getattr(alloc, "events", False):
        # the reader waits for this event on its own stream (the weight sender's send stream): the host
        # goes on exporting the next bucket (parallel/streams.py)
        from megatron_maspo.parallel import streams

        ready = streams.record(device=buf.device if buf.is_cuda else None)
    elif buf.is_cuda:
        # the bucket is complete before another process reads it; the buffer's own device, not the
        # thread's current one (the prefetch thread packs: issue 29, defect 4)
        torch.cuda.current_stream(buf.device).synchronize()
    release = alloc.releaser(buf) if alloc is not None else None
    done = None
    if digested is not None:  # one host read per bucket for the digests of the tensors it completes
        from megatron_maspo.rollout.digest import read

        names = [m.name for m, _ in pending if m.completes]
        specs = [digested[n][0] for n in names]
        values = read(digested.pop(n)[1] for n in names)
        done = {n: s.to_wire(v) for n, s, v in zip(names, specs, values)}
    return Bucket(buf, [m for m, _ in pending], checksum(buf) if with_checksum else None, index, release,
                  done, ready)


class Reassembler:
    """Receiver side of split tensors: pieces in, whole tensors out (one instance per sync).

    Each split tensor gets a buffer of its own (``nbytes``, on the device its first piece arrives on);
    a piece is copied in (the bucket buffer may be reused after the call), and the tensor is returned by
    :meth:`add` once its last byte arrived.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[TensorMeta, torch.Tensor, int]] = {}

    def add(self, meta: TensorMeta, piece: torch.Tensor) -> torch.Tensor | None:
        """Copy ``piece`` (uint8 [meta.part[1]]) into place; the whole tensor when complete, else None.

        Raises:
            ValueError: pieces out of order (a gap or an overlap), or a shape/dtype that changed
                between pieces of one name.
        """
        assert meta.part is not None
        start, length = meta.part
        if meta.name in self._open:
            first, buf, got = self._open[meta.name]
            if (first.dtype, first.shape) != (meta.dtype, meta.shape):
                raise ValueError(f"weight-sync piece of {meta.name!r} is {meta.dtype} {meta.shape}, earlier "
                                 f"pieces were {first.dtype} {first.shape}")
        else:
            first, buf, got = meta, torch.empty(meta.nbytes, dtype=torch.uint8, device=piece.device), 0
        if start != got or start + length > meta.nbytes:
            raise ValueError(f"weight-sync piece of {meta.name!r} covers bytes [{start}, {start + length}) "
                             f"but {got} of {meta.nbytes} bytes had arrived (pieces out of order?)")
        buf[start:start + length].copy_(piece)
        if start + length < meta.nbytes:
            self._open[meta.name] = (first, buf, start + length)
            return None
        self._open.pop(meta.name, None)
        return buf.view(_DTYPES[meta.dtype]).view(meta.shape)

    def check_done(self) -> None:
        """Raise ``ValueError`` naming any tensor some of whose pieces never arrived (end of a sync)."""
        if self._open:
            left = {n: f"{got}/{m.nbytes} bytes" for n, (m, _, got) in self._open.items()}
            raise ValueError(f"weight sync ended with split tensors incomplete: {left}")


def unpack_bucket(bucket: Bucket, *, verify: bool = True,
                  assembler: Reassembler | None = None) -> list[tuple[str, torch.Tensor]]:
    """Views into ``bucket.buffer`` named as packed (zero-copy: clone before reusing the buffer).

    Pieces of split tensors go to ``assembler``; a tensor completed by this bucket is listed (its own
    buffer, not a view), one still incomplete is not.

    Raises:
        ValueError: ``verify`` and the crc32 of the buffer differs from ``bucket.checksum``, a tensor's
            byte range falls outside the buffer, or a piece arrives without an ``assembler``.
    """
    buf = bucket.buffer
    if verify and bucket.checksum is not None:
        got = checksum(buf)
        if got != bucket.checksum:
            raise ValueError(f"weight-sync bucket {bucket.index} is corrupted: crc32 {got:#010x} != sent "
                             f"{bucket.checksum:#010x} (tensors {[m.name for m in bucket.metas][:4]}...)")
    out = []
    for m in bucket.metas:
        end = m.offset + m.span
        if end > buf.numel():
            raise ValueError(f"tensor {m.name!r} spans bytes [{m.offset}, {end}) beyond bucket {bucket.index} "
                             f"of {buf.numel()} bytes")
        if m.part is None:
            out.append((m.name, buf[m.offset:end].view(_DTYPES[m.dtype]).view(m.shape)))
            continue
        if assembler is None:
            raise ValueError(f"bucket {bucket.index} carries a piece of the split tensor {m.name!r}; "
                             "unpack the sync's buckets with a Reassembler (unpack_stream)")
        whole = assembler.add(m, buf[m.offset:end])
        if whole is not None:
            out.append((m.name, whole))
    return out


def unpack_stream(buckets: Iterable[Bucket], *, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every whole tensor of a sync's buckets, split ones reassembled; raises if a split tensor is left
    incomplete at the end. A bucket's views are valid until the next bucket is requested."""
    asm = Reassembler()
    for b in buckets:
        yield from unpack_bucket(b, verify=verify, assembler=asm)
    asm.check_done()


def meta_to_wire(m: TensorMeta) -> list:
    """``[name, dtype, shape, offset]`` plus ``start, length`` for a piece (plain lists: any serialiser)."""
    base = [m.name, m.dtype, list(m.shape), m.offset]
    return base if m.part is None else base + list(m.part)


def meta_from_wire(w: list) -> TensorMeta:
    """Inverse of :func:`meta_to_wire`."""
    n, d, s, o, *part = w
    return TensorMeta(n, d, tuple(s), o, tuple(part) if part else None)


def bucket_to_wire(bucket: Bucket) -> dict:
    """A plain-Python form (bytes + lists) that survives msgpack/pickle RPCs (vLLM ``collective_rpc``)."""
    return {"index": bucket.index, "checksum": bucket.checksum, "payload": bucket.buffer.numpy().tobytes(),
            "metas": [meta_to_wire(m) for m in bucket.metas], "digests": bucket.digests}


def bucket_from_wire(wire: dict) -> Bucket:
    """Inverse of :func:`bucket_to_wire` (the buffer is a writable copy of the payload)."""
    buf = torch.frombuffer(bytearray(wire["payload"]), dtype=torch.uint8)
    metas = [meta_from_wire(w) for w in wire["metas"]]
    return Bucket(buf, metas, wire["checksum"], wire["index"], digests=wire.get("digests"))

