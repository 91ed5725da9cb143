"""Per-tensor weight digests: what the engine holds, checked against what the trainer exported.

A sync can deliver every byte intact (crc32, byte counts) and the engine can still end up holding
something else: a reload that leaves a parameter unwritten or NaN, a post-load repack of a stale
copy, a dropped tensor. So after a sync each engine reads back the weights it *holds* and digests
them; the trainer digests the same tensors as it exports them; a mismatch stops the job with one line
naming the tensor and the engine (:class:`WeightVerifyError`).

The digest, exact integer arithmetic (identical on every device and rank, whatever the reduction order):

    words  x_i    the tensor's bytes read as int16 words (uint8 for 1-byte dtypes), i = flat word index
    block  j = i // B, k = i % B           (B = 4096 words)
    D(x) = sum_j a_j * (sum_k x_{jB+k} * b_k  mod P)  mod P,     P = 2^31 - 1 (prime)

with ``b_k in [1, 2^15]`` and ``a_j in [1, P-1]`` fixed pseudo-random weights (a quadratic hash of the
index). Every block sum is an integer below 2^42 (|x| <= 2^15, b <= 2^15, 4096 terms), exact even when
computed in float64 (< 2^53), and the rest is int64 modular arithmetic: the digest is bit-identical on
CPU and GPU, in any kernel order.

What it detects: any change of a single word (its term changes by ``delta * b_k * a_j``, never a multiple
of the prime P), a tensor left at another version, a NaN written over a value, swapped or shifted
elements, all with a miss probability ~1/P (5e-10) for unstructured differences. What it misses: a
change in words outside the sample (below), and two or more changes that cancel modulo P (a chance of
about 1 in 2 * 10^9 for unrelated corruption; an adversary could construct one: it is a checksum, not a
MAC).

The digest is additive over the words a piece covers, with weights fixed by the *global* word index:
the digest of a tensor is the sum (mod P) of the digests of disjoint pieces of it (``offset``), so an
engine that holds a tensor in parts (a fused or sharded parameter) digests each part where it lives.

Sampling: ``stride = S, phase = r`` digests only the blocks with ``j % S == r`` (contiguous 8 KiB reads:
the cost is ~1/S of the full digest). :func:`plan` picks, per sync and per tensor, full or sampled
(``rollout.verify_every``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_maspo.errors import WeightVerifyError

__all__ = ["BLOCK", "P", "Expected", "Spec", "WeightVerifyError", "compare", "digest", "plan", "read"]

P = 2**31 - 1
"""The prime modulus (a Mersenne prime: residues fit int32, products of two fit int64)."""
BLOCK = 4096
"""Words per block: the sampling unit (8 KiB of a 2-byte dtype)."""
_ROWS = 1024
"""Blocks per chunk of work (bounds the int64 temporaries at 32 MiB)."""


@dataclass(frozen=True)
class Spec:
    """Which blocks of one tensor a sync digests: those with ``block % stride == phase`` (stride 1 = all)."""

    stride: int = 1
    phase: int = 0

    def to_wire(self, value: int) -> list[int]:
        """``[stride, phase, digest]``: how a digest travels in ``Bucket.digests`` and bucket headers."""
        return [self.stride, self.phase, int(value)]


def _mix(idx: torch.Tensor, salt: int, modulus: int) -> torch.Tensor:
    """A quadratic hash of non-negative int64 indices into ``[1, modulus]`` (all intermediates < 2^62)."""
    u = (idx % P * 1_103_515_245 + salt) % P
    return (u * u + 12_345) % P % modulus + 1


@functools.cache
def _block_weights(device: torch.device) -> torch.Tensor:
    """``b_k``, k < BLOCK, as float64 on ``device`` (cached: computed once per device)."""
    return _mix(torch.arange(BLOCK, dtype=torch.int64, device=device), 7_919, 2**15).to(torch.float64)


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat word view: int16 for dtypes of 2+ bytes, uint8 for 1-byte ones."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.int16) if flat.element_size() >= 2 else flat.view(torch.uint8)


def num_blocks(num_words: int) -> int:
    """Blocks of a tensor of ``num_words`` words (:func:`words`), the last one possibly partial."""
    return -(-num_words // BLOCK)


def _rows_digest(rows: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``sum_j a_j (rows_j . b mod P) mod P`` for ``rows`` [m, BLOCK] (any int dtype), a 0-dim int64."""
    # A float64 matrix-vector product, and still exact: every product is an integer below 2^30 and every
    # partial sum below 2^42 < 2^53, so no rounding happens in any order (3x faster than int64 on CPU).
    s = (rows.to(torch.float64) @ _block_weights(rows.device)).to(torch.int64) % P
    return (s * _mix(block_ids, 104_729, P - 1) % P).sum() % P  # each term < P: the sum cannot overflow


def digest(t: torch.Tensor, spec: Spec = Spec(), *, offset: int = 0) -> torch.Tensor:
    """Digest of ``t``'s words (or of the sampled blocks), as a 0-dim int64 on ``t``'s device.

    Args:
        t: any contiguous-able tensor (one whole tensor, or one piece of a larger one).
        spec: the blocks to include (:class:`Spec`; default all).
        offset: word index of ``t``'s first word in the whole tensor (a piece); 0 for a whole tensor.

    Returns:
        ``D`` in ``[0, P)``; read it with ``int()`` (one host read: batch them with :func:`read`).
    """
    w = words(t)
    n = w.numel()
    total = torch.zeros((), dtype=torch.int64, device=w.device)
    if n == 0:
        return total
    dev = w.device
    first, last = offset // BLOCK, (offset + n - 1) // BLOCK
    # interior blocks lie wholly inside [offset, offset + n); head / tail ones are padded with zeros
    lo_full = first if offset % BLOCK == 0 else first + 1
    hi_full = last if (offset + n) % BLOCK == 0 else last - 1
    edges = [j for j in {first, last} if not lo_full <= j <= hi_full and j % spec.stride == spec.phase]
    for j in sorted(edges):
        a, b = max(j * BLOCK, offset), min((j + 1) * BLOCK, offset + n)
        row = torch.zeros(BLOCK, dtype=torch.int64, device=dev)
        row[a - j * BLOCK:b - j * BLOCK] = w[a - offset:b - offset]
        total = total + _rows_digest(row[None], torch.tensor([j], dtype=torch.int64, device=dev))
    if hi_full >= lo_full:
        j0 = lo_full + (spec.phase - lo_full) % spec.stride  # first sampled interior block
        m = (hi_full - j0) // spec.stride + 1 if j0 <= hi_full else 0
        step = spec.stride * BLOCK
        for c in range(0, m, _ROWS):
            k = min(_ROWS, m - c)
            start = (j0 + c * spec.stride) * BLOCK - offset
            rows = w[start:start + (k - 1) * step + BLOCK].unfold(0, BLOCK, step)  # [k, BLOCK], a view
            ids = j0 + (c + torch.arange(k, dtype=torch.int64, device=dev)) * spec.stride
            total = total + _rows_digest(rows, ids)
    return total % P


def read(values: Iterable[torch.Tensor]) -> list[int]:
    """Device digests to Python ints with one host read (``torch.stack(...).tolist()``)."""
    vals = list(values)
    return [int(v) for v in torch.stack(vals).cpu().tolist()] if vals else []


def plan(sync_index: int, every: int) -> Callable[[int], Spec] | None:
    """The digest spec per tensor for the ``sync_index``-th sync (0-based) under ``rollout.verify_every``.

    ``every = 0``: no verification (None). ``every = 1``: every sync digests every tensor in full.
    ``every = N > 1``: syncs ``0, N, 2N, ...`` digest in full; the others sample one block in ``N`` of
    each tensor (``stride = min(N, blocks)``, rotating the phase by sync), so a tensor of a single
    block (norms, biases) is always digested whole, a large one costs ~1/N, and N consecutive syncs
    cover every block.

    Returns:
        ``nblocks -> Spec`` for this sync, or None when nothing is verified.
    """
    if every <= 0:
        return None
    if every == 1 or sync_index % every == 0:
        return lambda nblocks: Spec()
    return lambda nblocks: Spec(min(every, nblocks), sync_index % min(every, nblocks))


class Expected:
    """The exported digests of one sync, collected from its buckets as an engine consumes them.

    ``for b in expected.watch(buckets)`` passes the buckets through and records each one's
    ``Bucket.digests``; after the load, :attr:`digests` holds ``{hf_name: [stride, phase, digest]}``
    (empty when the sender did not verify this sync).
    """

    def __init__(self) -> None:
        self.digests: dict[str, list[int]] = {}

    def watch(self, buckets: Iterable) -> Iterable:
        for b in buckets:
            if b.digests:
                self.digests.update(b.digests)
            yield b


def compare(expected: dict[str, list[int]], held: dict[str, int], *, engine: str, version: int) -> None:
    """Raise :class:`WeightVerifyError` (one line) for the first tensor whose held digest differs.

    Args:
        expected: ``{hf_name: [stride, phase, digest]}`` from the trainer's export.
        held: ``{hf_name: digest}`` of what the engine holds (same specs).
        engine: names the engine in the message (e.g. ``"builtin engine 0 (rank 1)"``).
        version: the weight version being verified.
    """
    for name, (stride, phase, want) in expected.items():
        got = held.get(name)
        if got != want:
            what = "not found in the engine" if got is None else f"digest {got:#010x} != exported {want:#010x}"
            sample = "full" if stride == 1 else f"blocks {phase} mod {stride}"
            raise WeightVerifyError(f"weight verification failed on {engine}: tensor {name!r} after weight "
                                    f"version {version}: {what} ({sample})")
