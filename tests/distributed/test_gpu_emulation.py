"""The GPU-semantics emulation (``MASPO_EMULATE_GPU=1``) makes "right on gloo, hangs on NCCL" fail on CPU.

- a side thread's device-bridge receive, posted before its sender is ready on the default stream, holds
  that stream: the main threads' next collective completes on plain gloo and fails under the emulation,
  naming the stream, the item holding it and its thread; from ``comm.side_stream()`` it completes;
- the rollout pool's weight receiver as it was before the fix (headers and payloads on the device bridge,
  the next sync's receive always posted on the default stream) deadlocks under the emulation with a
  built-in engine in a one-rank pool and with two engine owners gathering; the fixed receiver completes
  both, bitwise, with no host copy on the trainer's side of a device bridge;
- two threads posting on one group, and a device tensor on a group that is gloo on GPUs, are errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_maspo.parallel.launch import WorkerError, free_port, run_workers

SCRIPT = Path(__file__).with_name("_side_thread_hang.py")
ROOT = Path(__file__).resolve().parents[2]


def _torchrun(mode: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), mode]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    for k in ("MASPO_EMULATE_GPU", "MASPO_EMULATE_GPU_TIMEOUT_S"):
        if k not in env:
            full.pop(k, None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)


def test_side_thread_receive_on_the_default_stream_fails_only_under_emulation():
    # 5 s keeps the default suite short; with the 15 s the emulated run exits after 19 s
    # (docs/gpu-emulation.md)
    emu = {"MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPU_TIMEOUT_S": "5"}
    runs = {"plain": _torchrun("default"), "emulated": _torchrun("default", **emu),
            "side stream": _torchrun("side", **emu)}  # side by side: the emulated one waits 5 s
    out = {k: p.communicate(timeout=60)[0] for k, p in runs.items()}
    codes = {k: p.returncode for k, p in runs.items()}
    assert codes["plain"] == 0, out["plain"]
    assert codes["side stream"] == 0, out["side stream"]
    assert codes["emulated"] != 0, out["emulated"]
    msg = out["emulated"]
    assert "the default stream of cuda:1 of rank 1 blocked for 5 s" in msg, msg
    assert "held by Bridge.broadcast" in msg and "'side-receiver'" in msg, msg
    assert "waiting behind it: torch.distributed.all_reduce" in msg, msg


# ------------------------------------------------------------------------ the weight receiver, before/after
def _weights(seed: int) -> dict[str, torch.Tensor]:
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


class _OldSender:
    """The pre-fix protocol: header and payload of every bucket on the one (device) bridge."""

    def __init__(self, bridge) -> None:
        self.bridge = bridge

    def load_buckets(self, buckets, *, verify=True) -> None:
        from megatron_maspo.rollout.buckets import meta_to_wire

        for b in buckets:
            self.bridge.broadcast_object({"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum,
                                          "index": b.index, "n": b.buffer.numel(), "verify": verify})
            self.bridge.broadcast(b.buffer, 0)
        self.bridge.broadcast_object({"end": True})

    def stop(self) -> None:
        self.bridge.broadcast_object({"stop": True})


def _old_receiver(bridge, staging):
    """The pre-fix receiver loop: straight back to the next sync's receive, on the default stream."""
    from megatron_maspo.parallel import comm
    from megatron_maspo.rollout.buckets import Bucket, meta_from_wire
    from megatron_maspo.rollout.pool_sync import WeightReceiver

    class OldReceiver(WeightReceiver):
        def _run(self) -> None:
            try:
                while True:
                    staged = []
                    while True:
                        msg = self.bridge.broadcast_object(None, 0)
                        if "stop" in msg:
                            with self._cond:
                                self.stopped = True
                                self._cond.notify_all()
                            return
                        if "end" in msg:
                            break
                        release = None
                        if self.staging is not None:
                            buf, release = self.staging.alloc(msg["n"])
                        else:
                            buf = comm.device_empty(msg["n"])
                        self.bridge.broadcast(buf, 0)
                        staged.append(Bucket(buf, [meta_from_wire(w) for w in msg["bucket"]], msg["crc"],
                                             msg["index"], release=release))
                        self._verify = bool(msg["verify"])
                    with self._cond:
                        while self._slot is not None:
                            self._cond.wait()
                        self._slot = staged
                        self.received += 1
                        self._cond.notify_all()
            except BaseException as e:
                with self._cond:
                    self.error = e
                    self._cond.notify_all()

    return OldReceiver(bridge, None, staging=staging)


class _HostEngine:
    """An engine that reads each staged bucket on the host (what vLLM's relay to its workers does)."""

    def __init__(self) -> None:
        self.policy_version, self.loads = 0, []
        self.verify_s, self.verify_full_s = 0.0, None

    def deferred_check(self):
        return None  # verifies nothing (no digests in these syncs)

    def load_buckets(self, buckets, *, verify=True) -> None:
        self.loads.append([bytes(b.buffer.numpy()) for b in buckets])
        self.policy_version += 1


def _pool_world(rank: int, world: int, port: int, loop: str, kind: str):
    """Trainer rank 0 syncs twice; after each sync it waits for the batch the engines make with it (the
    batches bridge, host). Engine owners 1..world-1: wait for the version, "generate", gather in the pool."""
    import torch.distributed as dist

    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.bridge import Bridge
    from megatron_maspo.rollout.buckets import pack_buckets
    from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    ranks = tuple(range(world))
    weights = Bridge(store, "weights", ranks, rank, device=True)
    ctl = Bridge(store, "weights_ctl", ranks, rank)
    batches = Bridge(store, "batches", (1, 0), rank) if rank in (0, 1) else None
    pool = dist.new_group(list(range(1, world)))  # the rollout pool's group (NCCL on GPUs)
    syncs = [_weights(1), _weights(2)]
    if rank == 0:
        copied = comm.host_copy_bytes()
        sender = _OldSender(weights) if loop == "old" else WeightSender(weights, ctl)
        for v, w in enumerate(syncs, 1):
            pool_bufs = sender.bucket_pool(4096) if loop == "new" else None
            sender.load_buckets(pack_buckets(w.items(), 4096, with_checksum=pool_bufs is None, alloc=pool_bufs),
                                verify=pool_bufs is None)
            batch = batches.broadcast_object(None, 0)  # the engines' batch made with this version
            assert batch == {"made_with": v}, batch
        sender.stop()
        return {"host_copy_bytes": comm.host_copy_bytes() - copied}
    if kind == "engine":
        from megatron_maspo.model.tiny_hf import make_tiny_hf_model
        from megatron_maspo.rollout.builtin_engine import BuiltinEngine

        engine = BuiltinEngine(make_tiny_hf_model("qwen2", vocab_size=301, seed=0)[0])
        staging = None
    else:
        from megatron_maspo.rollout.transport import StagingPool

        engine, staging = _HostEngine(), StagingPool("cpu", shared=True)
    receiver = (_old_receiver(weights, staging) if loop == "old"
                else WeightReceiver(weights, ctl, staging=staging))
    out = {}
    for v in (1, 2):
        assert receiver.wait_for(lambda v=v: engine.policy_version >= v, engine, timeout_s=120)
        if kind == "engine":
            out[v] = {k: p.detach().clone() for k, p in engine.model.named_parameters()}
            from megatron_maspo.rollout.types import SamplingParams

            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=1.0, seed=0))
        assert all(comm.all_gather_object(True, group=pool))  # the pool agrees every batch
        if batches is not None:
            batches.broadcast_object({"made_with": v}, 0)
    assert receiver.wait_for(lambda: False, engine, timeout_s=120) is False
    receiver.join()
    return out


def _run(monkeypatch, world: int, loop: str, kind: str):
    monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
    monkeypatch.setenv("MASPO_EMULATE_GPU_TIMEOUT_S", "5")
    return run_workers(_pool_world, world, free_port(), loop, kind, timeout_s=120)


CASES = [pytest.param(2, "engine", id="one-rank-pool-builtin"),
         pytest.param(3, "gather", id="two-ranks-gather", marks=pytest.mark.slow)]  # 3 ranks: ~10-17 s


@pytest.mark.parametrize("world,kind", CASES)
def test_old_receiver_loop_deadlocks_under_emulation(monkeypatch, world, kind):
    with pytest.raises(WorkerError, match=r"the default stream of .* blocked for 5 s .*held by Bridge\.broadcast.*"
                                         r"'maspo-weight-receiver'"):
        _run(monkeypatch, world, "old", kind)


@pytest.mark.parametrize("world,kind", CASES)
def test_fixed_receiver_completes_under_emulation_bitwise(monkeypatch, world, kind):
    res = _run(monkeypatch, world, "new", kind)
    assert res[0] == {"host_copy_bytes": 0}  # device buckets, GPU to GPU: no host round trip
    if kind == "engine":
        for v, want in ((1, _weights(1)), (2, _weights(2))):
            assert res[1][v].keys() == want.keys()
            assert all(torch.equal(res[1][v][k], want[k]) for k in want), v


# ------------------------------------------------------------------------------ order and backends
def _order_world(rank: int, world: int):
    """Thread A posts on the world group and stays alive without handing off; B then posts: an error."""
    from megatron_maspo.parallel import comm

    errors: list[str] = []
    started, release = threading.Event(), threading.Event()

    def side() -> None:
        comm.all_reduce(torch.ones(1))
        started.set()
        release.wait(30)

    th = threading.Thread(target=side, name="prefetch-like")
    th.start()
    started.wait(30)
    try:
        comm.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    release.set()
    th.join()

    def side2() -> None:  # now with a hand-off: fine
        comm.all_reduce(torch.ones(1))
        comm.hand_off()
        started.set()
        release.wait(30)

    started.clear(), release.clear()
    th = threading.Thread(target=side2, name="handing-off")
    th.start()
    started.wait(30)
    comm.all_reduce(torch.ones(1))
    release.set()
    th.join()
    return errors


def test_two_threads_on_one_group_is_an_error_unless_handed_off(monkeypatch):
    monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
    res = run_workers(_order_world, 2, timeout_s=120)
    for errors in res:
        assert len(errors) == 1, errors
        assert "threads 'prefetch-like'" in errors[0] and "'MainThread'" in errors[0], errors
        assert "the world default group" in errors[0], errors


def _gloo_device_group(rank: int, world: int):
    import torch.distributed as dist

    from megatron_maspo.parallel import comm

    host = dist.new_group([0, 1], backend="gloo")  # like Megatron's gloo groups: host only on GPUs
    comm.all_reduce(torch.ones(2), group=host)  # a host tensor: fine
    weight = torch.nn.Parameter(torch.ones(2))
    try:
        comm.all_reduce(weight.detach() * 2, group=host)  # computed from a parameter: a device tensor
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


def test_device_tensor_on_a_group_that_is_gloo_on_gpus_is_an_error(monkeypatch):
    monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
    res = run_workers(_gloo_device_group, 2, timeout_s=120)
    for msg in res:
        assert msg is not None and "carries a device tensor on group [0, 1] (gloo: host only)" in msg, msg
        assert "a device group must be NCCL" in msg, msg
