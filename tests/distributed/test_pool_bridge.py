"""Between the pools of a disaggregated job (gloo, 3 spawned ranks): the ``Bridge`` group outside the
default one, and weights broadcast from the trainer's sender to two engine owners, each staging whole
syncs and applying them into a real built-in engine, bitwise, with split tensors and two syncs queued."""

from __future__ import annotations

import torch

from tests.distributed._launch import free_port, run_workers


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _worker(rank: int, world: int, port: int):
    import torch.distributed as dist

    from megatron_maspo.parallel.bridge import Bridge
    from megatron_maspo.rollout.buckets import pack_buckets
    from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    bridge = Bridge(store, "weights", (0, 1, 2), rank, device=True)
    ctl = Bridge(store, "weights_ctl", (0, 1, 2), rank)
    assert bridge.gpu_backend == "nccl" and ctl.gpu_backend == "gloo"
    # objects of any size both ways, root 0 and root 2
    got = ctl.broadcast_object({"from": 0, "blob": list(range(1000))} if rank == 0 else None, 0)
    assert got == {"from": 0, "blob": list(range(1000))}
    assert ctl.broadcast_object("tail" if rank == 2 else None, 2) == "tail"
    syncs = [_weights(1), _weights(2)]
    if rank == 0:
        sender = WeightSender(bridge, ctl)
        for w in syncs:  # back to back: the engines apply neither before both are sent
            # 4 KiB buckets: the 301 x 32 embedding (fp32, 38 KiB) is split over ten of them
            sender.load_buckets(pack_buckets(w.items(), 4096), verify=True)
        sender.stop()
        return {"sent": sender.policy_version}
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine

    engine = BuiltinEngine(make_tiny_hf_model("qwen2", vocab_size=301, seed=0)[0])
    receiver = WeightReceiver(bridge, ctl)
    out = {}
    for v in (1, 2):
        assert receiver.wait_for(lambda v=v: engine.policy_version >= v, engine, timeout_s=120)
        out[v] = {k: p.detach().clone() for k, p in engine.model.named_parameters()}
    assert receiver.wait_for(lambda: False, engine, timeout_s=120) is False  # the stop message
    receiver.join()
    return out


def test_weights_reach_every_engine_owner_bitwise():
    res = run_workers(_worker, 3, free_port(), timeout_s=240)
    assert res[0] == {"sent": 2}
    for owner in res[1:]:
        for v, want in ((1, _weights(1)), (2, _weights(2))):
            assert owner[v].keys() == want.keys()
            for k in want:
                assert torch.equal(owner[v][k], want[k]), (v, k)


# ------------------------------------------------- sends beside the packing (GPU emulation, review #7)
N = 4096  # bytes per bucket: one [1024] fp32 tensor each


def _overlap_worker(rank: int, world: int, port: int):
    """Trainer rank 0 packs six one-tensor buckets in the prefetch thread (a pool of two device buffers)
    and sends them; the owner reads bucket 0's header at once but posts its payload receive only 2 s
    later. Returns, on the sender, when each tensor was pulled from the export; on the owner, when it
    posted that first receive and every bucket's first value."""
    import time

    import torch.distributed as dist

    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.bridge import Bridge
    from megatron_maspo.rollout.buckets import Bucket, pack_buckets
    from megatron_maspo.rollout.pool_sync import WeightSender
    from megatron_maspo.rollout.transport import prefetch

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    bridge = Bridge(store, "weights", (0, 1), rank, device=True)
    ctl = Bridge(store, "weights_ctl", (0, 1), rank)
    assert bridge.on_device
    if rank == 0:
        sender = WeightSender(bridge, ctl)
        pool = sender.bucket_pool(N)
        pulls: list[float] = []

        weight = torch.nn.Parameter(torch.zeros(N // 4))  # a device tensor under the emulation

        def export():  # a device op per tensor (on the prefetch thread's stream), 0.2 s apart
            for i in range(6):
                time.sleep(0.2)
                t = weight.detach() + float(i)
                pulls.append(time.time())
                yield f"t{i}", t

        buckets = prefetch(pack_buckets(export(), N, with_checksum=False, alloc=pool), on_drop=Bucket.done)
        sender.load_buckets(buckets, verify=False)
        sender.stop()
        return {"pulls": pulls}
    firsts, posted = [], None
    with comm.side_stream("test receiver's stream") as stream:
        while True:
            msg = ctl.broadcast_object(None, 0)
            if "stop" in msg:
                break
            if "end" in msg:
                continue
            if posted is None:
                time.sleep(2.0)  # bucket 0 stays on the wire for 2 s
                posted = time.time()
            buf = comm.device_empty(msg["n"])
            bridge.broadcast(buf, 0)
            stream.synchronize()
            firsts.append(buf[:4].view(torch.float32).item())
    return {"posted": posted, "firsts": firsts}


def test_the_sender_exports_the_next_buckets_while_one_is_on_the_wire(monkeypatch):
    """Under the GPU emulation (streams modelled): while bucket 0's broadcast waits 2 s for its receiver,
    the prefetch thread goes on exporting tensors 2 and 3 (device work) and packs bucket 1 into the pool's
    other buffer; only packing bucket 2 into buffer 0 waits, for that broadcast to complete. With the sends
    on the stream the export runs on, tensor 2's export already waited behind broadcast 0 (2 tensors
    before it, not 4). Every bucket still arrives with its own bytes."""
    from megatron_maspo.parallel.launch import run_workers as fresh_workers

    monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
    monkeypatch.setenv("MASPO_EMULATE_GPU_TIMEOUT_S", "30")
    sent, got = fresh_workers(_overlap_worker, 2, free_port(), timeout_s=120)
    assert got["firsts"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    before = sum(t < got["posted"] for t in sent["pulls"])
    assert before == 4, (before, [round(t - got["posted"], 3) for t in sent["pulls"]])
