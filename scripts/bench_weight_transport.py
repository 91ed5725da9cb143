"""The colocated weight transport timed alone, split into its phases, against a plain device copy of the
same bytes measured in the same run.

    python scripts/bench_weight_transport.py           # on a GPU: a Qwen2.5-7B-sized bf16 state, CUDA IPC
    python scripts/bench_weight_transport.py --cpu     # rehearsal: shared memory, a cut-down state
    python scripts/bench_weight_transport.py --state 1.5b --bucket-mb 256 --reps 5

The sender is this process, the engine a spawned one, and both run the product's code: the trainer's
``pack_buckets`` into a double-buffered ``BucketPool`` (packed one bucket ahead by ``prefetch``, as
``rollout/weight_sync.py`` does), each pool buffer's handle sent once per sync (``HandleSlots``), one
blocking load call per bucket as vLLM's ``collective_rpc`` makes it; the engine maps the slots once
(``MappedBuffers``), copies each bucket out whole (``take_bucket``), reassembles split tensors and
loads them into a built-in engine's parameters (``BuiltinEngine.load_weights``, a copy per tensor, as
vLLM's default weight loader does). Phases, summed over one sync's buckets:

    pack       the sender packing the buckets alone (a pass without an engine)
    hand-over  from a bucket's load call leaving the sender to its buffer mapped in the engine
    load       the engine copying a bucket out and into its parameters, synchronised
    transfer   the whole sync, first bucket packed to last byte loaded (the phases overlap here)
    direct     the same sync with the engine loading straight from the mapped buffer, without the
               private copy the vLLM worker takes (its layer-wise reload keeps references to what it
               is given until a layer completes): the bound for a loader that copies in place at once
    verify     the engine digesting every parameter it holds against the sender's digests, apart

The first sync is checked (digests of every tensor in full) before anything is timed; a mismatch ends
the run with status 1. Then ``--reps`` syncs are timed; the median is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

STATES = {  # (hidden, intermediate, layers, heads, kv heads, vocab, tied)
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "cpu": (896, 4864, 4, 14, 2, 151936, True),  # Qwen2.5-0.5B's widths, 4 layers: ~0.4 GB in bf16
}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="rehearsal on CPU (shared memory, the 'cpu' state)")
    p.add_argument("--state", choices=sorted(STATES), default=None, help="default: 7b on GPU, cpu with --cpu")
    p.add_argument("--bucket-mb", type=float, default=None, help="default: 512 (rollout.bucket_mb); 64 with --cpu")
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args(argv)


def _config(state: str):
    import transformers

    h, i, n, heads, kv, v, tied = STATES[state]
    return transformers.Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=v,
                                    tie_word_embeddings=tied, max_position_embeddings=4096)


def _engine(cfg, dtype: torch.dtype, dev: str, inbox, outbox) -> None:
    """The engine process: maps the sender's pool buffers by slot and loads every bucket."""
    try:
        from megatron_maspo.rollout.buckets import (
            Bucket,
            Reassembler,
            meta_from_wire,
            unpack_bucket,
        )
        from megatron_maspo.rollout.builtin_engine import BuiltinEngine
        from megatron_maspo.rollout.transport import MappedBuffers, take_bucket

        device = torch.device(dev)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with device:  # random init on the device: the sync overwrites it
            engine = BuiltinEngine.from_hf_config(cfg, dtype=dtype, device=device)
        outbox.put(("ready", None))
        mapped = MappedBuffers(device.index if device.type == "cuda" else None)
        times = {"handover": 0.0, "load": 0.0}

        def one_sync(first):
            """One sync's tensors, bucket by bucket, as load_weights consumes them."""
            asm, msg = Reassembler(), first
            while msg[0] == "bucket":
                _, slot, handle, nbytes, metas, index, sent, take = msg
                view = mapped.view(slot, handle, nbytes)
                t_mapped = time.time()
                times["handover"] += t_mapped - sent
                # take: the vLLM worker's private copy first (its layer-wise reload keeps references);
                # direct: straight from the mapped buffer (a loader that copies in place at once)
                own = take_bucket(view, device) if take else view
                bucket = Bucket(own, [meta_from_wire(w) for w in metas], None, index)
                yield from unpack_bucket(bucket, verify=False, assembler=asm)  # each copied in as it comes
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times["load"] += time.time() - t_mapped
                outbox.put(("done", index))
                msg = inbox.get()
            asm.check_done()

        while True:
            msg = inbox.get()
            if msg[0] == "bucket":
                engine.load_weights(one_sync(msg))  # through to the sync's "end"
                mapped.close()  # the sender's pool may be freed
                outbox.put(("loaded", (time.time(), times["handover"], times["load"])))
                times.update(handover=0.0, load=0.0)
            elif msg[0] == "verify":
                t0 = time.perf_counter()
                engine.verify_weights(msg[1])  # raises WeightVerifyError naming the tensor
                outbox.put(("verified", time.perf_counter() - t0))
            else:
                return
    except BaseException as e:  # noqa: BLE001 (reported to the sender, which fails the run)
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def main(argv=None) -> int:
    import torch.multiprocessing as mp
    import transformers

    from megatron_maspo.rollout import digest
    from megatron_maspo.rollout.buckets import Bucket, meta_to_wire, pack_buckets
    from megatron_maspo.rollout.transport import BucketPool, HandleSlots, prefetch

    a = _args(argv)
    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --cpu for the rehearsal)")
    dev = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    state = a.state or ("cpu" if a.cpu else "7b")
    bucket_bytes = int((a.bucket_mb or (64 if a.cpu else 512)) * 2**20)
    dtype = torch.bfloat16
    cfg = _config(state)
    with torch.device("meta"):
        shapes = [(n, p.shape) for n, p in transformers.AutoModelForCausalLM.from_config(cfg).named_parameters()]
    g = torch.Generator(device=dev).manual_seed(0)
    named = [(n, torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(dtype)) for n, s in shapes]
    total = sum(t.numel() * t.element_size() for _, t in named)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(cfg, dtype, str(dev), inbox, outbox), daemon=True)
    proc.start()

    def get(kind: str):
        got, val = outbox.get(timeout=600)
        if got != kind:
            raise SystemExit(f"engine: {got}: {val}")
        return val

    def sync_gpu():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    cpu_pool = BucketPool(bucket_bytes, dev) if dev.type == "cpu" else None

    def pool() -> BucketPool:
        # as VllmEngine.bucket_pool: kept across syncs on CPU; allocated per sync on the GPU
        if cpu_pool is not None:
            cpu_pool.reclaim()
            return cpu_pool
        return BucketPool(bucket_bytes, dev)

    def one_sync(take: bool = True) -> tuple[float, float, float, int]:
        slots, n = HandleSlots(), 0
        sync_gpu()
        t0 = time.time()
        for b in prefetch(pack_buckets(named, bucket_bytes, with_checksum=False, alloc=pool()),
                          on_drop=Bucket.done):
            slot, handle = slots(b.buffer)
            inbox.put(("bucket", slot, handle, b.buffer.numel(), [meta_to_wire(m) for m in b.metas],
                       b.index, time.time(), take))
            get("done")  # one blocking load call per bucket (vLLM's collective_rpc)
            b.done()
            n += 1
        inbox.put(("end",))
        t_end, handover, load = get("loaded")
        return t_end - t0, handover, load, n

    def pack_alone() -> float:
        p = pool()
        sync_gpu()
        t0 = time.perf_counter()
        for b in pack_buckets(named, bucket_bytes, with_checksum=False, alloc=p):
            b.done()
        sync_gpu()
        return time.perf_counter() - t0

    status = 0
    try:
        get("ready")
        cold = one_sync()
        expected = {n: [1, 0, v] for (n, _), v in
                    zip(named, digest.read(digest.digest(t) for _, t in named))}
        inbox.put(("verify", expected))
        try:
            get("verified")
            print(f"check: every tensor's digest in the engine equals the sender's ({len(named)} tensors) ok")
        except SystemExit as e:
            print(f"check FAIL: {e}")
            return 1
        runs = sorted((one_sync() for _ in range(a.reps)), key=lambda r: r[0])
        secs, handover, load, n_buckets = runs[len(runs) // 2]
        direct = sorted(one_sync(take=False)[0] for _ in range(a.reps))[a.reps // 2]
        pack = statistics.median(pack_alone() for _ in range(a.reps))
        inbox.put(("verify", expected))
        verify = get("verified")
        # a plain copy of the same number of bytes on the same device (a 1 GiB buffer, copied repeatedly)
        chunk = min(total, 2**30)
        src, dst = torch.empty(chunk, dtype=torch.uint8, device=dev), torch.empty(chunk, dtype=torch.uint8, device=dev)
        dst.copy_(src)

        def copy_all() -> float:
            sync_gpu()
            t0, left = time.perf_counter(), total
            while left > 0:
                k = min(left, chunk)
                dst[:k].copy_(src[:k])
                left -= k
            sync_gpu()
            return time.perf_counter() - t0

        d2d = statistics.median(copy_all() for _ in range(a.reps))
        gb = total / 1e9
        kind = "cuda-ipc" if dev.type == "cuda" else "shared memory"
        print(f"\ntransport, {state}-sized {str(dtype).split('.')[-1]} state {total / 2**30:.2f} GiB in {n_buckets} "
              f"buckets of {bucket_bytes / 2**20:.0f} MiB over {kind} ({dev.type}); median of {a.reps} "
              f"(cold first sync {cold[0]:.3f} s)")
        print(f"{'phase':10} {'s':>8} {'GB/s':>8} {'x d2d':>7}")
        for name, s in (("pack", pack), ("hand-over", handover), ("load", load), ("transfer", secs),
                        ("direct", direct), ("verify", verify), ("d2d copy", d2d)):
            print(f"{name:10} {s:8.3f} {gb / max(s, 1e-9):8.2f} {d2d / max(s, 1e-9):7.2f}")
        print(f"SMOKE transport: {gb / secs:.2f} GB/s = {d2d / secs:.2f}x D2D, direct {d2d / direct:.2f}x; "
              f"pack {pack:.3f} s, hand-over {handover:.3f} s, load {load:.3f} s, verify {verify:.3f} s; "
              f"{n_buckets} buckets, digests ok")
        print(f"TRANSPORT: {gb / secs:.2f} GB/s = {d2d / secs:.2f}x a device copy ({gb / d2d:.1f} GB/s) of "
              f"{total / 2**30:.2f} GiB; pack {pack:.3f} s, hand-over {handover:.3f} s, load {load:.3f} s, "
              f"verify {verify:.3f} s apart; direct (no private copy) {gb / direct:.2f} GB/s = "
              f"{d2d / direct:.2f}x")
    finally:
        inbox.put(("stop",))
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
