"""Build the pieces the RL loop needs from a config: tokenizer + architecture, engine, data order.

Kept apart from ``loop.py`` so the loop reads like pseudo-code and each factory can be tested alone.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.config import MaspoConfig
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec

logger = logging.getLogger(__name__)


def build_policy_source(cfg: MaspoConfig, groups) -> tuple[Any, ArchSpec, Any]:
    """Tokenizer, architecture and a weight initialiser for the actor.

    ``model.source="tiny"``: the in-code byte tokenizer and a tiny Qwen2-style model with Megatron's
    seeded initialisation. Otherwise an HF folder: its tokenizer, its config.json and its safetensors
    (streamed into the Megatron shards).

    Raises:
        FileNotFoundError: the HF folder or its config.json is missing.
    """
    if cfg.model.source == "tiny":
        from megatron_maspo.data.tokenizer import build_byte_tokenizer

        tok = build_byte_tokenizer()
        spec = tiny_qwen2_spec(vocab_size=len(tok), num_layers=cfg.model.tiny_num_layers,
                               hidden_size=cfg.model.tiny_hidden_size)
        ckpt = cfg.model.megatron_checkpoint
        return tok, spec, (partial(_load_megatron, path=ckpt) if ckpt else None)
    from transformers import AutoTokenizer

    from megatron_maspo.model.hf_config import arch_spec_from_hf

    src = Path(cfg.model.source)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"model.source={cfg.model.source!r} is neither 'tiny' nor an HF folder "
                                "with config.json")
    tok = AutoTokenizer.from_pretrained(str(src))
    spec = arch_spec_from_hf(str(src))
    from megatron_maspo.model.moe import check_model_layout

    check_model_layout(cfg, spec)  # e.g. MoE at TP > 1 without sequence parallelism: one-line error
    if cfg.model.megatron_checkpoint:
        init = partial(_load_megatron, path=cfg.model.megatron_checkpoint)
    else:
        init = partial(_load_hf, spec=spec, groups=groups, src=src)
    return tok, spec, init


def _load_megatron(chunks, *, path):
    """Initial weights from a Megatron dist-checkpoint (any TP/PP layout), before DDP and optimizer."""
    from megatron_maspo.conversion.dist_ckpt import load_model_checkpoint

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.megatron_checkpoint={path!r}: no such checkpoint folder")
    load_model_checkpoint(chunks, path)


def _load_hf(chunks, *, spec, groups, src):
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights

    load_hf_weights(chunks, spec, groups, src)


def build_engine(cfg: MaspoConfig, spec: ArchSpec, tokenizer: Any, gpus: tuple[int, ...] | None = None):
    """The rollout engine (on the sending rank only). Weights arrive through the first sync.

    Args:
        gpus: the engine's node-local GPUs from the fleet layout (``rollout.fleet.owner_gpus``); None =
            the current device (built-in) / vLLM's default. Unused on CPU.
    """
    from megatron_maspo.model.hf_config import hf_config_dict

    hf_cfg = hf_config_dict(spec)
    if cfg.rollout.engine == "builtin":
        from megatron_maspo.rollout.builtin_engine import BuiltinEngine, engine_device

        dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32
        engine = BuiltinEngine.from_hf_config(hf_cfg, dtype=dtype, device=engine_device(gpus))
        engine.record_routing = cfg.model.routing_replay != "off"  # MoE routing replay
        return engine
    from megatron_maspo.rollout.vllm_engine import VllmEngine

    return VllmEngine.from_config(cfg, spec, tokenizer, gpus=gpus)


class PromptOrder:
    """Deterministic epoch-wise shuffled order over the dataset; its state is two integers."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0) -> None:
        if n < 1:
            raise ValueError("the prompt dataset is empty")
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next ``k`` dataset indices, reshuffling at each epoch boundary."""
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append(self._perm[self.cursor])
            self.cursor += 1
        return out

    def state(self) -> dict[str, int]:
        """Resumable position: ``{"epoch", "cursor"}``."""
        return {"epoch": self.epoch, "cursor": self.cursor}
