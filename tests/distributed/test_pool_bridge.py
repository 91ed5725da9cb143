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

    from megatron_maspo.parallel.comm import Bridge
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
