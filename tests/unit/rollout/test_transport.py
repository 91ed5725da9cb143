"""Bucket transport by handle: another process maps the sender's shared buffer (CPU shared memory)."""

from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch
import torch.multiprocessing as mp

from megatron_maspo.rollout.buckets import pack_buckets, unpack_bucket
from megatron_maspo.rollout.transport import BucketPool, StagingPool, open_shared, prefetch, share


def _reader(handle: bytes, nbytes: int, out):
    buf = open_shared(handle)[:nbytes]
    out.put(zlib.crc32(buf.numpy()))
    buf[0] = 255  # a write lands in the sender's memory: proof the buffer is shared, not copied


def test_other_process_maps_the_same_buffer():
    pool = BucketPool(1024)
    buf = pool.alloc(100)
    buf.copy_(torch.arange(100, dtype=torch.uint8))
    handle = share(buf)
    assert len(handle) < 1000  # a name, not the payload
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(handle, 100, q))
    p.start()
    crc = q.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert crc == zlib.crc32(torch.arange(100, dtype=torch.uint8).numpy())
    assert int(buf[0]) == 255


def test_pool_double_buffers_and_blocks_until_release():
    named = [(f"t{i}", torch.full((64,), float(i))) for i in range(6)]
    pool = BucketPool(300, count=2)
    buckets = pack_buckets(iter(named), 300, alloc=pool)  # 256 B tensors: one per bucket
    b0, b1 = next(buckets), next(buckets)
    assert b0.buffer.data_ptr() != b1.buffer.data_ptr()
    got = []
    th = threading.Thread(target=lambda: got.append(next(buckets)))
    th.start()
    time.sleep(0.2)
    assert not got  # both buffers are in use: the third bucket waits
    data0 = unpack_bucket(b0)[0][1].clone()
    b0.done()
    th.join(timeout=10)
    assert got and got[0].buffer.data_ptr() == b0.buffer.data_ptr()  # buffer 0 reused
    assert torch.equal(data0, named[0][1]) and torch.equal(unpack_bucket(got[0])[0][1], named[2][1])


def test_pool_rejects_an_oversized_bucket():
    with pytest.raises(ValueError, match="pool buffer"):
        BucketPool(16, count=1).alloc(17)


def test_prefetch_keeps_order_and_reraises():
    assert list(prefetch(iter(range(5)))) == [0, 1, 2, 3, 4]

    def bad():
        yield 1
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        list(prefetch(bad()))


def test_prefetch_drops_unconsumed_items_on_close():
    dropped = []
    gen = prefetch(iter(range(10)), depth=2, on_drop=dropped.append)
    assert next(gen) == 0
    gen.close()
    assert dropped and all(d > 0 for d in dropped)


def test_staging_pool_is_shared_from_the_start_and_recycles():
    """Rollout pool (issue 32): staged buckets live in shared memory before share() sees them (no move,
    no copy per bucket), and a released buffer serves the next bucket that fits."""
    pool = StagingPool("cpu", shared=True)
    a, release_a = pool.alloc(300)
    assert a.is_shared() and a.numel() == 300
    ptr = a.data_ptr()
    share(a)
    assert a.data_ptr() == ptr  # already shared: share() hands out its name, nothing moves
    b, _ = pool.alloc(200)  # a is still held: a new buffer
    assert pool.allocated == 2 and b.data_ptr() != ptr
    release_a()
    c, _ = pool.alloc(250)  # fits a's buffer: reused
    assert c.data_ptr() == ptr and c.numel() == 250 and pool.allocated == 2
    d, _ = pool.alloc(400)  # nothing free fits
    assert pool.allocated == 3 and d.numel() == 400
    plain, _ = StagingPool("cpu").alloc(10)
    assert not plain.is_shared()


def test_staging_pool_takes_the_best_fit_from_anywhere_in_its_free_list():
    """The smallest free buffer that fits is taken even when others of other sizes come first (it was
    removed from the free list with ``list.remove``, whose tensor ``==`` raised)."""
    pool = StagingPool("cpu")
    held = [pool.alloc(n) for n in (500, 300, 100)]
    ptrs = [b.data_ptr() for b, _ in held]
    for _, release in held:
        release()
    small, _ = pool.alloc(90)
    mid, _ = pool.alloc(250)
    assert (small.data_ptr(), mid.data_ptr(), pool.allocated) == (ptrs[2], ptrs[1], 3)


def _slot_reader(inbox, outbox):
    """An engine-side loop over (slot, handle, nbytes) messages, as the vLLM worker runs it."""
    from megatron_maspo.rollout.transport import MappedBuffers, take_bucket

    mapped = MappedBuffers()
    try:
        while (msg := inbox.get(timeout=60)) is not None:
            own = take_bucket(mapped.view(*msg), torch.device("cpu"))
            outbox.put(("crc", zlib.crc32(own.numpy()), len(mapped)))
        mapped.view(7, None, 1)  # a slot this sync never sent
    except ValueError as e:
        outbox.put(("error", str(e), len(mapped)))


def test_each_pool_buffer_is_sent_and_mapped_once_per_sync():
    """Issue 55: a sync of six buckets through a two-buffer pool sends two handles (each later bucket
    names its buffer's slot) and the engine maps two buffers, reading every bucket's bytes right.
    The product sent and opened a handle per bucket (a CUDA-IPC open per bucket on the GPU)."""
    from megatron_maspo.rollout.transport import HandleSlots

    pool, slots = BucketPool(4096), HandleSlots()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_slot_reader, args=(inbox, outbox))
    p.start()
    handles, crcs = [], []
    try:
        for i in range(6):
            buf = pool.alloc(1000 + 100 * i)
            buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
            slot, handle = slots(buf)
            handles.append(handle)
            inbox.put((slot, handle, buf.numel()))
            kind, crc, mapped = outbox.get(timeout=120)
            assert kind == "crc" and crc == zlib.crc32(buf.numpy()), kind
            crcs.append(crc)
            pool.releaser(buf)()  # the load returned: the buffer may be refilled
        inbox.put(None)
        kind, msg, mapped = outbox.get(timeout=120)
    finally:
        p.join(timeout=60)
    assert sum(h is not None for h in handles) == 2 == len(slots) == mapped
    assert kind == "error" and "slot 7" in msg
    assert len(set(crcs)) == 6


def test_a_freed_buffer_never_reuses_a_slot_it_could_alias():
    """The slot table keeps every buffer it named alive, so a buffer freed by its owner cannot be
    reallocated at the same address and read through a receiver's stale mapping."""
    from megatron_maspo.rollout.transport import HandleSlots

    slots = HandleSlots()
    first = slots(torch.empty(256, dtype=torch.uint8).share_memory_())
    second = slots(torch.empty(256, dtype=torch.uint8).share_memory_())  # the first temporary is gone
    assert [s for s, _ in (first, second)] == [0, 1] and all(h is not None for _, h in (first, second))
    with pytest.raises(ValueError, match="prefix"):
        slots(torch.empty(256, dtype=torch.uint8)[8:])
