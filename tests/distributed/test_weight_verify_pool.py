"""Staged syncs between the pools (gloo, 2 processes: the trainer's sender and one engine owner with a
real built-in engine), verified where they land:

- an engine that corrupts one element, or keeps one parameter at its previous version, after loading
  a staged sync stops with the one-line error naming tensor and engine: in that sync's ``wait_for``
  when the check runs in the pause, at ``pop_applied`` (before the batch those weights made may leave)
  when it runs beside generation (``defer_verify``, the rollout pool's setting for this engine);
- a sender that dies half-way through a sync never leaves a half-applied version: the owner's
  ``wait_for`` raises, and the engine still holds the previous version, bitwise.
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from tests.distributed._launch import free_port, run_workers

BUCKET = 4096  # the 301 x 32 fp32 embedding is split over ten buckets


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _bridges(rank: int, world: int, port: int, timeout_s: float = 120.0):
    import torch.distributed as dist

    from megatron_maspo.parallel.bridge import Bridge

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    ranks = tuple(range(world))
    return (Bridge(store, "weights", ranks, rank, device=True, timeout_s=timeout_s),
            Bridge(store, "weights_ctl", ranks, rank, timeout_s=timeout_s))


def _engine():
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine

    engine = BuiltinEngine(make_tiny_hf_model("qwen2", vocab_size=301, seed=0)[0])
    engine.label = "builtin engine 0"
    return engine


def _faulty_engine_world(rank: int, world: int, port: int, kind: str, defer: bool):
    from megatron_maspo.rollout import digest
    from megatron_maspo.rollout.buckets import pack_buckets
    from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender

    bridge, ctl = _bridges(rank, world, port)
    if rank == 0:
        sender = WeightSender(bridge, ctl)
        for i, seed in enumerate((1, 2)):
            sender.load_buckets(pack_buckets(_weights(seed).items(), BUCKET, digests=digest.plan(i, 1)))
        sender.stop()
        return None
    engine = _engine()
    engine.defer_verify = defer
    receiver = WeightReceiver(bridge, ctl)
    assert receiver.wait_for(lambda: engine.policy_version >= 1, engine, timeout_s=120)
    pause = receiver.pop_applied()
    engine.inject_fault(kind, "model.layers.0.self_attn.k_proj.weight")
    error = where = None
    try:
        receiver.wait_for(lambda: engine.policy_version >= 2, engine, timeout_s=120)
        where = "pop_applied"
        receiver.pop_applied()
    except digest.WeightVerifyError as e:
        error, where = str(e), where or "wait_for"
    receiver.wait_for(lambda: False, engine, timeout_s=120)  # the stop message
    receiver.join()
    return {"error": error, "where": where, "pause": pause}


def test_a_faulty_engine_stops_in_the_sync_that_loaded_it():
    for kind, defer in (("flip", False), ("stale", False), ("flip", True), ("stale", True)):
        _, owner = run_workers(_faulty_engine_world, 2, free_port(), kind, defer, timeout_s=240)
        assert owner["error"] == owner["error"].splitlines()[0]
        assert owner["error"].startswith("weight verification failed on builtin engine 0: tensor "
                                         "'model.layers.0.self_attn.k_proj.weight' after weight version 2: digest")
        assert owner["where"] == ("pop_applied" if defer else "wait_for")
        (first,) = owner["pause"]  # the first sync: activated in a measured pause, verified in full
        assert first["engine_pause_s"] > 0 and first["verify_full_s"] == first["verify_s"] > 0
        if not defer:  # checked inside the pause; deferred, it ran beside the (here idle) engine loop
            assert first["engine_pause_s"] >= first["verify_s"]


def _dying_sender(rank: int, world: int, port: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from megatron_maspo.rollout import digest
    from megatron_maspo.rollout.buckets import pack_buckets
    from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender

    bridge, ctl = _bridges(rank, world, port, timeout_s=60)
    if rank == 0:
        sender = WeightSender(bridge, ctl)
        sender.load_buckets(pack_buckets(_weights(1).items(), BUCKET, digests=digest.plan(0, 1)))
        buckets = list(pack_buckets(_weights(2).items(), BUCKET, digests=digest.plan(1, 1)))

        def half_then_die():
            yield from buckets[:len(buckets) // 2]
            os._exit(3)  # the sender's process dies mid-transfer: no "end", no stop

        sender.load_buckets(half_then_die())
        return
    engine = _engine()
    receiver = WeightReceiver(bridge, ctl)
    assert receiver.wait_for(lambda: engine.policy_version >= 1, engine, timeout_s=60)
    try:
        receiver.wait_for(lambda: engine.policy_version >= 2, engine, timeout_s=60)
        error = ""
    except RuntimeError as e:
        error = str(e)
    want = _weights(1)
    held = dict(engine.model.named_parameters())
    out.put({"error": error, "version": engine.policy_version,
             "same": all(torch.equal(held[k].detach(), want[k]) for k in want)})


def test_a_sender_dying_mid_sync_leaves_the_previous_version_whole():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dying_sender, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=180)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert procs[0].exitcode == 3
    assert "weight receiver: the bridge from the training pool failed" in res["error"]
    assert res["version"] == 1 and res["same"]
