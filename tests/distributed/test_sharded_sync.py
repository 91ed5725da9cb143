"""Sharded weight sync between the pools (gloo, CPU): every pipeline stage (and, for experts, every EP rank)
of a real Megatron trainer sends its own tensors to the rollout pool's built-in engines; after each of two
syncs every engine holds exactly the trainer's full export (``export_hf_weights``, the funnel's stream),
bitwise. Also: the point-to-point transport carries the same plan, no sender packs more than its planned
share, and a stage that dies mid-transfer ends the job with its traceback."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.spec import ArchSpec
from tests.distributed._launch import WorkerError, free_port, run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DENSE = ArchSpec(family="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, kv_channels=16, vocab_size=251, max_position_embeddings=64,
                 add_qkv_bias=True, tie_word_embeddings=True)
MOE = ArchSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
               num_query_groups=2, kv_channels=8, vocab_size=97, max_position_embeddings=64, qk_layernorm=True,
               num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_norm_topk_prob=True)
BUCKET = 20_000  # bytes: smaller than the embedding, so one tensor is split over buckets


def _worker(rank: int, world: int, port: int, spec: ArchSpec, tp: int, pp: int, ep: int, engines: int,
            transport: str, die: bool, bucket: int = BUCKET, timeout: float = 120.0, max_links: int = 16):
    import torch.distributed as dist

    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.config import RolloutConfig
    from megatron_maspo.rollout.pool_sync import WeightReceiver
    from megatron_maspo.rollout.pools import TRAIN, PoolLayout
    from megatron_maspo.rollout.transfer_plan import plan_pool_transfer
    from megatron_maspo.rollout.weight_sync import sync_weights_sharded
    from megatron_maspo.train.process.distributed import JobPools
    from megatron_maspo.train.rollouts.pool import bridges, receiving_end, sending_end

    dist.destroy_process_group()  # the launcher's world: this job splits into two pools
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    lay = PoolLayout(world=world, engine_ranks=engines, tp=tp, pp=pp, ep=ep, moe=spec.is_moe,
                     sync_transport=transport, max_links=max_links)
    assert len(lay.weight_links) == min(len(lay.sender_ranks), max_links) or transport == "p2p"
    role = lay.role(rank)
    size = lay.trainer_world if role == TRAIN else lay.engine_ranks
    comm.init_pool_group(store, role, lay.pool_rank(rank), size, timeout)
    pools = JobPools(lay, rank, store)
    links, _ = bridges(RolloutConfig(placement="disaggregated", engine_ranks=engines, pool_timeout_s=timeout,
                                     max_weight_links=max_links), pools)
    if role == TRAIN:
        groups = init_parallel(tp=tp, pp=pp, ep=ep, seed=3)
        torch.manual_seed(3 + groups.pp_rank * 10 + groups.ep_rank)
        opts = ModelBuildOptions(tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=16,
                                 sequence_parallel=spec.is_moe and tp > 1)  # Megatron: MoE at TP > 1 needs SP
        chunks = build_model_chunks(spec, opts, pp_rank=groups.pp_rank)
        plan = plan_pool_transfer(spec, lay, "float32")
        sender = sending_end(links, rank)
        out = {"exports": [], "sent": []}
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for m in chunks:
                        for p in m.parameters():
                            p.mul_(1.5).add_(0.01)
            # the funnel's stream, cloned: at TP 1 a Direct tensor comes out as the parameter itself
            ref = {n: t.clone() for n, t in export_hf_weights(chunks, spec, groups, dtype=torch.float32)}
            if die and version == 2 and rank == lay.sender_ranks[-1]:
                sender = _DiesAfterOneBucket(sender, rank)
            stats = sync_weights_sharded(chunks, spec, groups, sender, plan, bucket_bytes=bucket,
                                         dtype=torch.float32, verify_checksums=True)
            out["sent"].append(stats.payload_bytes)
            if rank == 0:
                out["exports"].append(ref)
        if sender is not None:
            sender.stop()
        out["plan_bytes"] = plan.bytes_by_sender().get(rank, 0)
        return out
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine

    if not links:  # not an engine owner
        return {}
    engine = BuiltinEngine.from_hf_config(hf_config_dict(spec))
    ((bridge, ctl), *more), turns = receiving_end(links)
    order = [s.name for s in plan_pool_transfer(spec, lay, "float32").sends]
    receiver = WeightReceiver(bridge, ctl, more=more, order=order, turns=turns)
    got = []
    for v in (1, 2):
        assert receiver.wait_for(lambda v=v: engine.policy_version >= v, engine, timeout_s=timeout)
        got.append({k: p.detach().clone() for k, p in engine.model.state_dict().items()})
    assert receiver.wait_for(lambda: False, engine, timeout_s=timeout) is False
    receiver.join()
    return {"weights": got}


class _DiesAfterOneBucket:
    """A stage sender that raises after its first bucket of a sync is on the wire."""

    def __init__(self, sender, rank: int):
        self.sender, self.rank = sender, rank
        self.policy_version = sender.policy_version

    def bucket_pool(self, bucket_bytes):
        return self.sender.bucket_pool(bucket_bytes)

    def load_buckets(self, buckets, *, verify=True):
        def first_then_die():
            yield next(iter(buckets))
            raise RuntimeError(f"stage sender rank {self.rank} dies mid-transfer")
        self.sender.load_buckets(first_then_die(), verify=verify)

    def stop(self):
        self.sender.stop()


def _engine_tensor(params: dict, name: str) -> torch.Tensor:
    """An engine parameter by checkpoint name (transformers 5 MoE modules keep experts fused)."""
    from megatron_maspo.rollout.fused_experts import fused_slot

    slot = fused_slot(name, params) if name not in params else None
    return params[name] if slot is None else params[slot[0]][slot[1]]


def _check(res: list, lay_world: int, engines: int) -> None:
    trainers = res[:lay_world - engines]
    exports = trainers[0]["exports"]
    for t in trainers:  # no rank packs more than its planned share; the shares add up to one copy
        assert t["sent"] == [t["plan_bytes"]] * 2
    total = sum(t["plan_bytes"] for t in trainers)
    assert total == sum(v.numel() * v.element_size() for v in exports[0].values())
    assert max(t["plan_bytes"] for t in trainers) < total  # several senders
    owners = [r for r in res[lay_world - engines:] if r]
    assert len(owners) == engines
    for owner in owners:
        for v in (0, 1):
            held = owner["weights"][v]
            for name, want in exports[v].items():
                assert torch.equal(_engine_tensor(held, name), want), (v, name)
    assert not torch.equal(exports[0]["model.norm.weight"], exports[1]["model.norm.weight"])


@pytest.mark.parametrize("transport", ["broadcast", pytest.param("p2p", marks=pytest.mark.slow)])
def test_two_stages_send_their_own_shares_to_two_engines(transport):
    res = run_workers(_worker, 4, free_port(), DENSE, 1, 2, 1, 2, transport, False, fresh=True, timeout_s=300)
    _check(res, 4, 2)


@pytest.mark.slow
def test_tp2_pp2_trainer_to_two_engines_bitwise():
    res = run_workers(_worker, 6, free_port(), DENSE, 2, 2, 1, 2, "broadcast", False, fresh=True, timeout_s=400)
    _check(res, 6, 2)


@pytest.mark.parametrize("emulate", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["gloo", "gpu_emulation"])
def test_two_stages_sharing_one_link_take_turns(monkeypatch, emulate):
    """``rollout.max_weight_links=1``: both stage senders and both owners on one link; stage 1 takes part
    in stage 0's turn (its buckets into a scratch buffer) before it sends its own, and both say stop in
    turn. The engines still hold the export bitwise, in the global order."""
    if emulate:
        monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
        monkeypatch.setenv("MASPO_EMULATE_GPU_TIMEOUT_S", "30")
    res = run_workers(_worker, 4, free_port(), DENSE, 1, 2, 1, 2, "broadcast", False, BUCKET, 60.0, 1,
                      fresh=True, timeout_s=300)
    _check(res, 4, 2)


def test_ep2_experts_sent_by_their_own_ep_ranks():
    res = run_workers(_worker, 3, free_port(), MOE, 1, 1, 2, 1, "broadcast", False, fresh=True, timeout_s=300)
    _check(res, 3, 1)
    assert res[0]["plan_bytes"] > 0 and res[1]["plan_bytes"] > 0


def test_a_stage_dying_mid_transfer_ends_the_job_with_its_traceback():
    with pytest.raises(WorkerError, match="stage sender rank 1 dies mid-transfer"):
        run_workers(_worker, 3, free_port(), DENSE, 1, 2, 1, 1, "broadcast", True, fresh=True, timeout_s=200)


@pytest.mark.parametrize("emulate", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["gloo", "gpu_emulation"])
def test_tp2_ep2_stage_whose_second_ep_rank_is_the_dense_senders_tp_peer(monkeypatch, emulate):
    """TP 2 x EP 2 on one stage of two ranks (no expert-DP replica): EP rank 1 (trainer rank 1) sends its
    experts over its own link while its export still has to join rank 0's TP gathers of every later
    layer. Read link by link, the owner would wait for link 0's end, rank 1 would stop after two buckets
    (its pool of two) and stop gathering: a hang until the timeout. 2 KiB buckets give rank 1 a dozen."""
    if emulate:
        monkeypatch.setenv("MASPO_EMULATE_GPU", "1")
        monkeypatch.setenv("MASPO_EMULATE_GPU_TIMEOUT_S", "30")
    res = run_workers(_worker, 3, free_port(), MOE, 2, 1, 2, 1, "broadcast", False, 2048, 30.0, fresh=True,
                      timeout_s=200)
    _check(res, 3, 1)
    assert res[0]["plan_bytes"] > 0 and res[1]["plan_bytes"] > 0
