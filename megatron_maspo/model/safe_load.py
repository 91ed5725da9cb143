"""Checkpoint files read without running code from them (``docs/security.md``).

A checkpoint downloaded from elsewhere is data, and a pickle is a program: ``torch.load(weights_only=False)``
or ``pickle.load`` on a crafted file runs whatever it names. So:

* the RNG state is written as safetensors (``rng/rank<r>.safetensors``: flat tensors, no code);
  the ``rng/rank<r>.pt`` of older checkpoints is read with ``weights_only=True`` only;
* before Megatron and torch read a checkpoint, :func:`screen_checkpoint` checks that every ``*.pt``
  file loads with ``weights_only=True`` and that torch's dist-checkpoint ``.metadata`` (a plain pickle
  torch unpickles without restriction) names only the classes torch's checkpoint metadata is made of.

A refusal is one line naming the file (``InputError``, exit 2), not a torch traceback.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.errors import InputError

_TRACKER = "tracker/"

# What a torch_dist ``.metadata`` pickle may refer to. In torch's checkpoint modules: only classes
# defined there (dataclasses and enums, harmless to construct); elsewhere: the names listed. Taken from
# checkpoints this project writes (torch 2.x); anything else is refused rather than imported.
_DCP_MODULES = frozenset({
    "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.storage",
    "torch.distributed.checkpoint._extension",
})
_METADATA_ALLOWED: dict[str, frozenset[str]] = {
    "torch": frozenset({"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                        "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "complex64"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a lookup in torch's own layout table
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id: a path, no I/O
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


def save_rng(state: dict, path: Path) -> None:
    """Write ``_rng_state()``'s dict (``cpu``, ``cuda`` or None, ``tracker``: name -> tensor) as safetensors."""
    from safetensors.torch import save_file

    flat = {"cpu": state["cpu"]}
    if state.get("cuda") is not None:
        flat["cuda"] = state["cuda"]
    flat.update({_TRACKER + k: v for k, v in state.get("tracker", {}).items()})
    save_file({k: v.contiguous() for k, v in flat.items()}, str(path))


def load_rng(rng_dir: Path, rank: int) -> dict | None:
    """The RNG state dict of ``rank`` (safetensors, or an old ``.pt`` read with ``weights_only=True``).

    Returns None when the checkpoint has none for this rank.

    Raises:
        InputError: the file cannot be read as plain tensors (naming it).
    """
    st_path, pt_path = rng_dir / f"rank{rank}.safetensors", rng_dir / f"rank{rank}.pt"
    if st_path.exists():
        from safetensors.torch import load_file

        try:
            flat = load_file(str(st_path))
        except Exception as e:  # a truncated or foreign file: safetensors says why
            raise InputError(f"{st_path}: not a readable safetensors file ({e})") from None
        return {"cpu": flat["cpu"], "cuda": flat.get("cuda"),
                "tracker": {k[len(_TRACKER):]: v for k, v in flat.items() if k.startswith(_TRACKER)}}
    if pt_path.exists():
        return _load_plain_pt(pt_path)
    return None


def _load_plain_pt(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with a one-line refusal naming ``path``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path}: refused, it is not plain tensor data (a pickle naming code: {first[:160]}); "
                         "see docs/security.md") from None
    except Exception as e:
        raise InputError(f"{path}: cannot be read ({type(e).__name__}: {str(e)[:160]})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the names in ``_METADATA_ALLOWED``; any other global is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and name in _METADATA_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if "." not in name and module in _DCP_MODULES:
            obj = super().find_class(module, name)  # importing torch's own module runs no file code
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(f"names {module}.{name}")


def screen_metadata(path: Path) -> None:
    """Raise ``InputError`` unless torch's ``.metadata`` pickle at ``path`` names only checkpoint classes."""
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise InputError(f"{path}: refused, its pickle {e} (not a torch checkpoint metadata class); "
                         "see docs/security.md") from None
    except Exception as e:  # truncated, empty
        raise InputError(f"{path}: cannot be read ({type(e).__name__}: {str(e)[:160]})") from None


def screen_checkpoint(path: Path) -> None:
    """Check every pickle of the checkpoint folder ``path`` before torch or Megatron loads it.

    Raises:
        InputError: one file is refused or unreadable (the message names it).
    """
    for pt in sorted(path.rglob("*.pt")):
        _load_plain_pt(pt)
    meta = path / ".metadata"
    if meta.exists():
        screen_metadata(meta)
