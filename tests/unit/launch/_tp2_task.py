"""Smoke-test task for the local NeMo-Run launch: a Megatron GPT forward/backward at TP=2 under torchrun.

Stands in for ``maspo train`` where that entry point is absent. It reads the resolved config the
launcher wrote (proving the file travels), joins the gloo world torchrun set up, runs one step of the
tiny model at TP=2 and writes ``tp2_result.json`` next to the config (rank 0).

    python -m tests.unit.launch._tp2_task --config runs/launch/NAME/config.yaml   # under torchrun
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
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.model.spec import tiny_qwen2_spec
    from megatron_maspo.parallel.groups import destroy_parallel, init_parallel

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config_path = Path(parser.parse_args().config)
    cfg = load_config(config_path)
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    groups = init_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.train.seed)
    spec = tiny_qwen2_spec(num_layers=cfg.model.tiny_num_layers, hidden_size=cfg.model.tiny_hidden_size)
    opts = ModelBuildOptions(tp=groups.tp, pp=groups.pp, make_vocab_size_divisible_by=8)
    (model,) = build_model_chunks(spec, opts, pp_rank=groups.pp_rank)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, 17), generator=g)
    pos = torch.arange(16).expand(2, 16).contiguous()
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    gnorm_sq = sum(float(w.grad.pow(2).sum()) for w in model.parameters() if w.grad is not None)
    if dist.get_rank() == 0:
        out = {"world": dist.get_world_size(), "tp": groups.tp, "loss": float(loss),
               "local_grad_norm_sq": gnorm_sq, "world_size_in_config": cfg.parallel.world_size,
               "omp": os.environ.get("OMP_NUM_THREADS")}
        (config_path.parent / "tp2_result.json").write_text(json.dumps(out))
    destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
