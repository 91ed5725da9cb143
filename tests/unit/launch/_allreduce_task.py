"""Cheapest real launch task: join torchrun's gloo world, all-reduce, report (rank 0) next to the config.

    python -m tests.unit.launch._allreduce_task --config runs/launch/NAME/config.yaml   # under torchrun
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from megatron_maspo.config import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config_path = Path(parser.parse_args().config)
    cfg = load_config(config_path)
    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        out = {"world": dist.get_world_size(), "sum": float(x), "world_size_in_config": cfg.parallel.world_size,
               "omp": os.environ.get("OMP_NUM_THREADS"), "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
        (config_path.parent / "allreduce_result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
