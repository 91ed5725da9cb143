"""Launch options, job environment and the resolved config (no nemo_run needed)."""

from __future__ import annotations

import pytest

from megatron_maspo.config import load_config
from megatron_maspo.launch.job import (
    MULTINODE_ENV,
    LaunchOptions,
    job_env,
    parse_env,
    resolve_for_cluster,
    train_args,
    write_config,
)
from megatron_maspo.recipes.registry import load_recipe


def test_multinode_env_defaults_are_overridable():
    opts = LaunchOptions(executor="slurm", account="a", nodes=4, env={"NCCL_IB_HCA": "=mlx5_0:1"})
    env = job_env(opts)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1"
    for key in ("NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL"):
        assert env[key] == MULTINODE_ENV[key]
    single = job_env(LaunchOptions(executor="local", gpus_per_node=2), cuda=False)
    assert "NCCL_IB_HCA" not in single and "CUDA_DEVICE_MAX_CONNECTIONS" not in single


@pytest.mark.parametrize("kw,needle", [
    ({"executor": "k8s"}, "accepted"),
    ({"executor": "slurm"}, "--account"),
    ({"executor": "local", "nodes": 2}, "one node"),
    ({"executor": "slurm", "account": "a", "time": "4h"}, "HH:MM:SS"),
    ({"executor": "slurm", "account": "a", "container_mounts": ["/lustre"]}, "src:dst"),
    ({"name": "a b"}, "name="),
])
def test_bad_options_are_rejected(kw, needle):
    with pytest.raises(ValueError, match=needle):
        LaunchOptions(**kw)


def test_parse_env():
    assert parse_env(["A=1", "B_2=x=y"]) == {"A": "1", "B_2": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env(["NOVALUE"])


def test_resolved_config_round_trips_with_the_cluster_world_size(tmp_path):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    opts = LaunchOptions(executor="slurm", account="a", nodes=2, job_dir=str(tmp_path), name="j")
    resolved = resolve_for_cluster(cfg, opts)
    assert resolved.parallel.world_size == 16 and resolved.parallel.dp == 8
    assert resolved.checkpoint.run_dir == str(tmp_path / "j" / cfg.checkpoint.run_dir)
    path = write_config(resolved, opts)
    assert path == tmp_path / "j" / "config.yaml"
    assert load_config(path) == resolved
    assert train_args(path) == ["train", "--config", str(path)]
    with pytest.raises(ValueError, match="world_size=6 is not divisible by tp"):  # the 14B recipe has TP 4
        resolve_for_cluster(load_recipe("r1_distill_qwen_14b_maspo"),
                            LaunchOptions(executor="slurm", account="a", nodes=1, gpus_per_node=6))
