"""Published Qwen3.5 checkpoints <-> the text model ``maspo convert`` reads, vision and MTP kept by name.

Published Qwen3.5 / Qwen3.5-MoE checkpoints are multimodal wrappers (``Qwen3_5(Moe)ForConditionalGeneration``,
``model_type`` ``qwen3_5`` / ``qwen3_5_moe``): the text model's config sits under ``text_config``, its
tensors under ``model.language_model.``, the head at ``lm_head.weight``, the vision tower under
``model.visual.`` and the multi-token-prediction layer under ``mtp.``; MoE experts may be stored fused,
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``.

:func:`split_wrapper` writes the text model as a plain ``Qwen3_5(Moe)ForCausalLM`` folder (per-expert keys,
what ``maspo convert hf-to-megatron`` reads) and returns the names it left out. :func:`join_wrapper` puts a
(trained, exported) text model back into the wrapper: the same key names and expert layout as the original,
every vision / MTP tensor copied from the original by name, the original's ``config.json`` with the
text config's fields. Renames and splits only: a round trip is bitwise. One output shard per input shard,
so the host holds one shard at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

WRAPPERS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
            "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
"""Wrapper ``model_type`` -> (text ``model_type``, text CausalLM class)."""
TEXT_PREFIX, WRAPPED_PREFIX = "model.", "model.language_model."
_FUSED = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")


def _shards(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    return files


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _write(tensors: dict[str, torch.Tensor], out: Path, index: dict[str, str]) -> None:
    from safetensors.torch import save_file

    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, out.name))


def _finish(out_dir: Path, index: dict[str, str], total: int) -> None:
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2))


def split_wrapper(src: str | Path, out: str | Path) -> list[str]:
    """Write the text model of wrapper checkpoint ``src`` to the new folder ``out``.

    Returns:
        the wrapper's tensor names not in the text model (vision tower, MTP), sorted.

    Raises:
        ValueError: ``src`` is not a Qwen3.5 wrapper checkpoint (the message names what is wrong).
    """
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") not in WRAPPERS or "text_config" not in cfg:
        raise ValueError(f"{src / 'config.json'}: model_type={cfg.get('model_type')!r} with text_config expected; "
                         f"accepted: {sorted(WRAPPERS)}")
    out.mkdir(parents=True, exist_ok=False)
    text_type, arch = WRAPPERS[cfg["model_type"]]
    text = dict(cfg["text_config"], model_type=text_type, architectures=[arch])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    (out / "config.json").write_text(json.dumps(text, indent=2))
    left, index, total = [], {}, 0
    for shard in _shards(src):
        kept: dict[str, torch.Tensor] = {}
        for name, t in _read(shard).items():
            if name == "lm_head.weight":
                kept[name] = t
            elif name.startswith(WRAPPED_PREFIX):
                name = TEXT_PREFIX + name[len(WRAPPED_PREFIX):]
                m = _FUSED.match(name)
                if m is None:
                    kept[name] = t
                elif m["w"] == "down_proj":  # [E, H, I]
                    kept.update({f"{m['pre']}.{e}.down_proj.weight": x for e, x in enumerate(t)})
                else:  # [E, 2I, H]: gate rows, then up rows
                    for e, x in enumerate(t):
                        gate, up = x.chunk(2, dim=0)
                        kept[f"{m['pre']}.{e}.gate_proj.weight"], kept[f"{m['pre']}.{e}.up_proj.weight"] = gate, up
            else:
                left.append(name)
        total += sum(t.numel() * t.element_size() for t in kept.values())
        _write(kept, out / shard.name, index)
    _finish(out, index, total)
    _copy_assets(src, out)
    return sorted(left)


def join_wrapper(text: str | Path, original: str | Path, out: str | Path) -> None:
    """Write wrapper checkpoint ``out``: ``original`` with its text model replaced by folder ``text``.

    Key names, expert layout (fused or per expert, as ``original`` stores them) and shard assignment
    follow ``original``; vision / MTP tensors are copied from it by name.

    Raises:
        ValueError: a text-model tensor of ``original`` has no counterpart in ``text``, or ``text`` has
            tensors ``original`` lacks.
    """
    text, original, out = Path(text), Path(original), Path(out)
    cfg = json.loads((original / "config.json").read_text())
    new_text = json.loads((text / "config.json").read_text())
    cfg["text_config"] = {**cfg["text_config"], **{k: v for k, v in new_text.items()
                                                    if k not in ("model_type", "architectures")}}
    trained: dict[str, torch.Tensor] = {}
    for shard in _shards(text):
        trained.update(_read(shard))
    out.mkdir(parents=True, exist_ok=False)
    try:
        _join_tensors(trained, original, out, text)
    except BaseException:
        shutil.rmtree(out)  # no half-written checkpoint
        raise
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_assets(original, out)


def _copy_assets(src: Path, out: Path) -> None:
    """Tokenizer, chat template, generation config: every file but the weights, their index and config.json."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)


def _join_tensors(trained: dict[str, torch.Tensor], original: Path, out: Path, text: Path) -> None:
    used, index, total = set(), {}, 0
    for shard in _shards(original):
        tensors: dict[str, torch.Tensor] = {}
        for name, t in _read(shard).items():
            if name != "lm_head.weight" and not name.startswith(WRAPPED_PREFIX):
                tensors[name] = t  # vision tower, MTP: kept by name
                continue
            local = name if name == "lm_head.weight" else TEXT_PREFIX + name[len(WRAPPED_PREFIX):]
            m = _FUSED.match(local)
            if m is None:
                parts = [local]
                tensors[name] = trained[local] if local in trained else _missing(local)
            elif m["w"] == "down_proj":
                parts = [f"{m['pre']}.{e}.down_proj.weight" for e in range(t.shape[0])]
                tensors[name] = torch.stack([trained[p] if p in trained else _missing(p) for p in parts])
            else:
                parts = [f"{m['pre']}.{e}.{w}.weight" for e in range(t.shape[0]) for w in ("gate_proj", "up_proj")]
                pairs = [trained[p] if p in trained else _missing(p) for p in parts]
                tensors[name] = torch.stack([torch.cat(pairs[i:i + 2]) for i in range(0, len(pairs), 2)])
            used.update(parts)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        _write(tensors, out / shard.name, index)
    if extra := sorted(set(trained) - used):
        raise ValueError(f"{text}: tensors the original checkpoint has no place for: {extra[:8]}")
    _finish(out, index, total)


def _missing(name: str) -> torch.Tensor:
    raise ValueError(f"the text model has no tensor {name!r} for the wrapper checkpoint")
