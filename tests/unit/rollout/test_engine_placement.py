"""Engine device placement is data (``FleetLayout.engine_gpus``) and the engines apply it (issue 29, defect 1).

Before: every vLLM engine of a node started with all GPUs visible and put its worker on ``cuda:0`` (the
second of 8 engines then fails vLLM's free-memory check; with ``vllm_tp=2`` every engine claimed GPUs 0-1).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_maspo.rollout.fleet import (
    EnginePlacement,
    FleetLayout,
    check_placement,
    cuda_visible_devices,
    owner_gpus,
    place_engine,
    processes_per_node,
)


def test_eight_engines_on_one_node_get_eight_distinct_gpus():
    f = FleetLayout(world=8, rollout_tp=1)
    gpus = [f.engine_gpus(e, 8) for e in range(8)]
    assert gpus == [(g,) for g in range(8)]
    assert {f.engine_node(e, 8) for e in range(8)} == {0}
    assert [p.gpus for p in f.placement(8)] == gpus


def test_vllm_tp2_engines_get_disjoint_pairs():
    f = FleetLayout(world=8, rollout_tp=2, tp=2)
    assert [f.engine_gpus(e, 8) for e in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    flat = [g for p in f.placement(8) for g in p.gpus]
    assert sorted(flat) == list(range(8))


def test_multi_node_placement_uses_node_local_indices():
    f = FleetLayout(world=32, rollout_tp=4, tp=4, pp=2)  # 4 nodes x 8 GPUs, 8 engines
    pl = f.placement(8)
    assert [(p.owner, p.node, p.gpus) for p in pl[:3]] == [(0, 0, (0, 1, 2, 3)), (4, 0, (4, 5, 6, 7)),
                                                          (8, 1, (0, 1, 2, 3))]
    assert pl[-1] == EnginePlacement(engine=7, owner=28, node=3, gpus=(4, 5, 6, 7))
    one = FleetLayout(world=16, rollout_tp=1)
    assert (one.engine_node(9, 8), one.engine_gpus(9, 8)) == (1, (1,))


def test_an_engine_never_spans_nodes():
    with pytest.raises(ValueError, match="spans two nodes"):
        FleetLayout(world=12, rollout_tp=4).engine_gpus(1, 6)  # ranks 4..7 on nodes of 6 GPUs
    with pytest.raises(ValueError, match="whole nodes"):
        FleetLayout(world=12, rollout_tp=1).engine_gpus(0, 8)


def test_an_engine_larger_than_a_node_takes_whole_nodes():
    # vLLM TP 16 on 8-GPU nodes (the published one-step-off DeepSeek-V3 engines): 2 nodes each, node-major
    f = FleetLayout(world=32, rollout_tp=16)
    pl = f.placement(8)
    assert [(p.owner, p.node, p.nodes, p.leaders) for p in pl] == [(0, 0, 2, (0, 8)), (16, 2, 2, (16, 24))]
    assert pl[1].gpus == tuple(range(8)) and pl[1].tp == 16 and pl[1].node_ids == (2, 3)
    assert [pl[1].node_rank_of(r) for r in (16, 24, 17)] == [0, 1, None]
    with pytest.raises(ValueError, match="part of a node of 8 GPUs.*multiple of 8"):
        FleetLayout(world=24, rollout_tp=12).placement(8)  # 12 GPUs: one and a half nodes
    with pytest.raises(ValueError, match="part of a node of 8 GPUs"):
        place_engine(0, 4, 16, 8)  # owner in the middle of a node


def test_spanning_engines_claim_every_gpu_of_each_node():
    a = place_engine(0, 0, 16, 8)
    with pytest.raises(ValueError, match="engines 0 and 1 both placed on node 1 GPU 0"):
        check_placement([a, EnginePlacement(engine=1, owner=8, node=1, gpus=(0, 1))])


def test_check_placement_names_a_shared_gpu():
    # today's behaviour: every engine on GPU 0 of its node
    same = [EnginePlacement(engine=e, owner=e, node=0, gpus=(0,)) for e in range(8)]
    with pytest.raises(ValueError, match="engines 0 and 1 both placed on node 0 GPU 0"):
        check_placement(same)
    check_placement([EnginePlacement(engine=e, owner=8 * e, node=e, gpus=(0,)) for e in range(2)])


def test_visible_devices_map_through_the_jobs_own_list():
    assert cuda_visible_devices((2, 3)) == "2,3"
    assert cuda_visible_devices((1,), "4,5,6,7") == "5"
    assert cuda_visible_devices((0, 1), "GPU-a,GPU-b") == "GPU-a,GPU-b"
    with pytest.raises(ValueError, match="outside"):
        cuda_visible_devices((2,), "0,1")


def test_owner_gpus_from_the_launcher_environment():
    f = FleetLayout(world=16, rollout_tp=2)
    env = {"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "2"}
    assert processes_per_node(16, env) == 8
    assert processes_per_node(16, {"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert owner_gpus(f, 10, env) == (2, 3)  # rank 10 = node 1, local rank 2
    assert owner_gpus(f, 11, env) is None  # not an owner
    with pytest.raises(RuntimeError, match="node-major"):
        owner_gpus(f, 10, {"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "0"}, cuda=True)


def test_builtin_engine_uses_the_owner_ranks_gpu():
    from megatron_maspo.rollout.builtin_engine import engine_device

    assert engine_device((3,), cuda=True) == torch.device("cuda", 3)
    assert engine_device((3,), cuda=False) == torch.device("cpu")


class _FakeLLM:
    seen: list[str | None] = []

    def __init__(self, **kwargs):
        import os

        _FakeLLM.seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm_on_gpu(monkeypatch):
    """``vllm.LLM`` replaced by a recorder, the device seam saying CUDA: the GPU branch of VllmEngine."""
    from megatron_maspo.rollout import vllm_engine

    mod = types.ModuleType("vllm")
    mod.LLM = _FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(vllm_engine, "on_cuda", lambda: True)  # decided once per process: patch the seam
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _FakeLLM.seen = []
    return _FakeLLM


def test_vllm_engines_start_with_only_their_gpus_visible(fake_vllm_on_gpu, tmp_path):
    import os

    from megatron_maspo.rollout.vllm_engine import VllmEngine

    f = FleetLayout(world=8, rollout_tp=1)
    for e in range(8):
        VllmEngine(str(tmp_path), gpus=f.engine_gpus(e, 8))
    assert fake_vllm_on_gpu.seen == [str(g) for g in range(8)]  # 8 engines, 8 distinct GPUs
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # restored once vLLM has started
    f2 = FleetLayout(world=8, rollout_tp=2)
    fake_vllm_on_gpu.seen = []
    os.environ["CUDA_VISIBLE_DEVICES"] = "7,6,5,4,3,2,1,0"
    for e in range(4):
        VllmEngine(str(tmp_path), tensor_parallel_size=2, gpus=f2.engine_gpus(e, 8))
    assert fake_vllm_on_gpu.seen == ["7,6", "5,4", "3,2", "1,0"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0"


def test_vllm_engine_refuses_mismatched_or_in_process_placement(fake_vllm_on_gpu, tmp_path, monkeypatch):
    from megatron_maspo.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match="one GPU per vLLM TP rank"):
        VllmEngine(str(tmp_path), tensor_parallel_size=2, gpus=(0,))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(RuntimeError, match="cuda:0"):
        VllmEngine(str(tmp_path), gpus=(3,))
    VllmEngine(str(tmp_path), gpus=(0,))  # GPU 0 is where an in-process core lands anyway
