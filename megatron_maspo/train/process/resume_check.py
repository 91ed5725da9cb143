"""Before a resume: the settings a checkpoint cannot be loaded under differently, compared in one line.

Megatron finds such a difference only inside ``dist_checkpointing.load``, as a 50-line traceback per rank
(``Global shape mismatch ... layer_norm_weight``, ``KeyError: optimizer.state.fp32_param...``). The run
directory's ``config.yaml`` says how the checkpoints were written, so ``--resume`` compares it with this
run's config first and names the first differing fields, before any model is built.

What a resume *can* change is left alone: TP / PP / EP / CP sizes (the checkpoint is resharded on load),
the world size, learning rate and schedule (the config wins, ``train/actor/checkpoint.py``), sampling
and reward settings. What it cannot (each found by a real resume failing at load):

* the model's shapes: ``model.source``, ``model.arch``, the tiny model's layers and width, the vocabulary
  padding, the MoE expert bias buffer; for an HF source, its ``config.json`` against the architecture
  recorded in the checkpoint (``maspo_arch.json``), since a folder can change under the same path;
* the tokenizer, which comes with ``model.source``;
* the optimizer state's layout: ``parallel.distributed_optimizer``, ``model.bf16`` / ``model.fp16`` (fp32
  master copies or not), ``parallel.vpp`` (model chunks are separate keys);
* the algorithm, ``loss.method``: a run is one method; to continue from its weights with another, start a
  new run from them (``model.megatron_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from megatron_maspo.errors import ConfigError

FIXED_ON_RESUME = (
    "model.source", "model.arch", "model.tiny_num_layers", "model.tiny_hidden_size",
    "model.make_vocab_size_divisible_by", "model.moe_expert_bias",
    "model.bf16", "model.fp16", "parallel.distributed_optimizer", "parallel.vpp",
    "loss.method",
)
_SHOWN = 3  # fields named in the one line; the rest are counted


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _same_folder(a: Any, b: Any) -> bool:
    """``runs/../hf/x`` and ``hf/x``: one folder under two spellings (only folders that exist here)."""
    return isinstance(a, str) and isinstance(b, str) and Path(a).is_dir() and Path(a).resolve() == Path(b).resolve()


def config_differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, current value)`` for each field of :data:`FIXED_ON_RESUME` that differs.

    A field absent from ``saved`` (a config.yaml from before the field existed) is not compared.
    """
    out = []
    for field in FIXED_ON_RESUME:
        head = field.rsplit(".", 1)
        if not isinstance(_get(saved, head[0]), dict) or head[1] not in _get(saved, head[0]):
            continue
        old, new = _get(saved, field), _get(current, field)
        if old != new and not (field == "model.source" and _same_folder(old, new)):
            out.append((field, old, new))
    return out


def arch_differences(ckpt: Path, source: str) -> list[tuple[str, Any, Any]]:
    """The architecture fields of HF folder ``source`` that differ from the checkpoint's ``maspo_arch.json``
    (none when either is absent: a tiny model, an older checkpoint)."""
    rec = ckpt / "maspo_arch.json"
    if source == "tiny" or not (Path(source) / "config.json").is_file() or not rec.is_file():
        return []
    from megatron_maspo.model.hf_config import arch_spec_from_hf

    try:
        saved = json.loads(rec.read_text())
        now = dataclasses.asdict(arch_spec_from_hf(source))
    except (ValueError, TypeError, OSError):
        return []  # unreadable either way: the model build reports it with its own message
    return [(f"{source}/config.json: {k}", saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]]


def check_resume_config(run_dir: str | Path, cfg: Any, ckpt: Path | None) -> None:
    """Refuse a resume whose config differs from the run's saved one where a checkpoint cannot follow.

    Args:
        run_dir: the run directory (its ``config.yaml``; absent: nothing to compare).
        cfg: this run's resolved ``MaspoConfig``.
        ckpt: the checkpoint to resume from (its recorded architecture), or None.

    Raises:
        ConfigError: one line naming the first differing fields, both values, and what to do.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return  # load_config has already parsed it when --resume used it; a --config run keeps its own
    diffs = config_differences(saved, dataclasses.asdict(cfg))
    if ckpt is not None and not diffs:
        diffs = arch_differences(ckpt, cfg.model.source)
    if not diffs:
        return
    named = ", ".join(f"{f} {old!r} -> {new!r}" for f, old, new in diffs[:_SHOWN])
    more = f" (and {len(diffs) - _SHOWN} more)" if len(diffs) > _SHOWN else ""
    raise ConfigError(f"--resume {run_dir}: its checkpoints cannot be loaded with this config: {named}{more}; "
                      "these cannot change on resume: start a new checkpoint.run_dir (to keep the weights, "
                      "with model.megatron_checkpoint=<checkpoint> when the shapes match)")
