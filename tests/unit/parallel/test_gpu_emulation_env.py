"""The emulation's switches, read from the environment (pure: nothing is installed in this process)."""

from __future__ import annotations

import pytest

from megatron_maspo.parallel import gpu_emulation as emu


def test_off_unless_asked():
    assert not emu.requested({})
    assert not emu.requested({"MASPO_EMULATE_GPU": "0"})
    assert emu.requested({"MASPO_EMULATE_GPU": "1"})


def test_nodes_split_a_one_host_job_node_major():
    base = {"MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPUS_PER_NODE": "2", "WORLD_SIZE": "5"}
    got = [emu.node_env({**base, "RANK": str(r)}) for r in range(5)]
    assert [g["LOCAL_RANK"] for g in got] == ["0", "1", "0", "1", "0"]
    assert [g["GROUP_RANK"] for g in got] == ["0", "0", "1", "1", "2"]
    assert {g["LOCAL_WORLD_SIZE"] for g in got} == {"2"} and {g["NNODES"] for g in got} == {"3"}
    assert emu.node_env({**base, "MASPO_EMULATE_GPU": "0", "RANK": "3"}) == {}  # nodes need the emulation
    with pytest.raises(ValueError, match="MASPO_EMULATE_GPUS_PER_NODE=0"):
        emu.node_env({**base, "MASPO_EMULATE_GPUS_PER_NODE": "0", "RANK": "0"})


def test_processes_per_node_follows_the_emulated_nodes(monkeypatch):
    from megatron_maspo.rollout.fleet import processes_per_node

    env = emu.node_env({"MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPUS_PER_NODE": "1", "WORLD_SIZE": "3",
                        "RANK": "2"})
    assert processes_per_node(3, env) == 1
