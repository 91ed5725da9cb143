"""Checkpoint files read without running code from them (``docs/security.md``).

A checkpoint downloaded from elsewhere is data, and a pickle is a program: ``torch.load(weights_only=False)``
or ``pickle.load`` on a crafted file runs whatever it names. So:

* the RNG state is written as safetensors (``rng/rank<r>.safetensors``: flat tensors, no code);
  the ``rng/rank<r>.pt`` of older checkpoints is read with ``weights_only=True`` only;
* before Megatron and torch read a checkpoint, :func:`screen_checkpoint` checks that every ``*.pt``
  file loads with ``weights_only=True``, that torch's dist-checkpoint ``.metadata`` (a plain pickle
  torch unpickles without restriction) names only the classes torch's checkpoint metadata is made of,
  and that every bytes item inside the ``*.distcp`` shards (e.g. ``_extra_state``, which torch's reader
  hands to ``torch.load(weights_only=False)``) loads with ``weights_only=True``;
* what the conversion needs from the metadata (the tensors' dtypes) is read through the same screened
  unpickler (:func:`read_dcp_metadata`), never through Megatron's ``load_tensors_metadata``.

None of this depends on ``manifest.json``: whoever hands over a checkpoint can rewrite its manifest.

A refusal is one line naming the file (``InputError``, exit 2), not a torch traceback.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.errors import InputError
from megatron_maspo.model import mcore_compat

_TRACKER = "tracker/"

# What a torch_dist ``.metadata`` pickle may refer to. In torch's checkpoint modules: only the dataclasses
# and enums defined there (pickle rebuilds a dataclass with __new__ and a dict update, an enum by value:
# no method of theirs runs; the readers and writers there do I/O and are refused); elsewhere: the names
# listed. Taken from
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


def _load_plain_pt(src: Path | io.BytesIO, where: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` of a file or stream, with a one-line refusal naming ``where``
    (default: the file)."""
    where = where or str(src)
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{where}: refused, it is not plain tensor data (a pickle naming code: {first[:160]}); "
                         "see docs/security.md") from None
    except Exception as e:
        raise InputError(f"{where}: cannot be read ({type(e).__name__}: {str(e)[:160]})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the names in ``_METADATA_ALLOWED``; any other global is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and name in _METADATA_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if "." not in name and module in _DCP_MODULES:
            obj = super().find_class(module, name)  # importing torch's own module runs no file code
            if (isinstance(obj, type) and obj.__module__ == module
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                return obj
        raise pickle.UnpicklingError(f"names {module}.{name}")


def read_dcp_metadata(path: Path) -> Any:
    """Torch's ``.metadata`` pickle at ``path``, unpickled by the allow-list unpickler.

    Returns:
        the ``torch.distributed.checkpoint.metadata.Metadata`` object.

    Raises:
        InputError: a global outside the allow-list, an unreadable file, or not a ``Metadata``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise InputError(f"{path}: refused, its pickle {e} (not a torch checkpoint metadata class); "
                         "see docs/security.md") from None
    except Exception as e:  # truncated, empty
        raise InputError(f"{path}: cannot be read ({type(e).__name__}: {str(e)[:160]})") from None
    if not isinstance(md, Metadata):
        raise InputError(f"{path}: refused, it holds a {type(md).__name__}, not a torch checkpoint Metadata")
    return md


def screen_metadata(path: Path) -> None:
    """Raise ``InputError`` unless torch's ``.metadata`` pickle at ``path`` names only checkpoint classes."""
    read_dcp_metadata(path)


def _shard_file(folder: Path, rel: Any) -> Path:
    """``folder/rel`` for a shard the metadata names; a name leading elsewhere is refused."""
    if not isinstance(rel, str) or not rel or Path(rel).name != rel or rel in (".", ".."):
        raise InputError(f"{folder / '.metadata'}: refused, it names the shard file {str(rel)[:80]!r} "
                         "outside the checkpoint folder")
    return folder / rel


def screen_bytes_items(folder: Path, md: Any) -> None:
    """Load every bytes item of the ``*.distcp`` shards with ``weights_only=True`` (none is kept).

    Torch's reader passes each bytes item (a ``torch.save`` stream inside a shard, at the offset and length
    the metadata records) to ``torch.load(weights_only=False)``; Megatron stores its ``ShardedObject`` data
    (``_extra_state``) there. Tensor items need no screen: torch reads them with ``weights_only=True``.

    Raises:
        InputError: an item is refused or unreadable (naming the shard and the item).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
            continue  # a tensor: torch.load(weights_only=True) in torch's reader
        shard = _shard_file(folder, getattr(info, "relative_path", None))
        where = f"{shard}: bytes item {index.fqn!r}"
        if getattr(info, "transform_descriptors", None):  # compression etc.: maspo never writes them
            raise InputError(f"{where}: refused, it is stored with stream transforms "
                             f"{list(info.transform_descriptors)} that maspo does not screen")
        try:
            with open(shard, "rb") as f:
                f.seek(int(info.offset))
                data = f.read(int(info.length))
        except (OSError, TypeError, ValueError) as e:
            raise InputError(f"{where}: cannot be read ({type(e).__name__}: {str(e)[:160]})") from None
        obj = _load_plain_pt(io.BytesIO(data), where)
        if "_extra_state" in index.fqn:
            screen_extra_state(obj, where)


# Transformer Engine's module extra state (FP8 scales and recipe) is a uint8 tensor holding a plain
# pickle, which TE's ``set_extra_state`` hands to ``pickle.loads``: the checkpoint's bytes item passes the
# weights-only screen as "a tensor", and the code would run inside the load. What TE pickles there: a
# dict of tensors (torch's reduce: ``_rebuild_tensor_v2`` over storages saved as bytes) and its recipe
# (dataclasses, enums and named tuples of ``transformer_engine.common.recipe``).
_EXTRA_STATE_ALLOWED: dict[str, frozenset[str]] = {
    **_METADATA_ALLOWED,
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_tensor"}),
}
_TE_RECIPE_MODULE = "transformer_engine.common.recipe"


def _storage_from_bytes(b: bytes) -> Any:
    # torch's own ``_load_from_bytes`` loads these with weights_only=False: the screen loads them with True
    return torch.load(io.BytesIO(b), weights_only=True)


class _ExtraStateUnpickler(pickle.Unpickler):
    """Unpickles a TE extra-state pickle if it names only tensors, plain containers and TE recipe types."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == mcore_compat.TORCH_STORAGE_LOADER or (
                (module, name) == mcore_compat.MCORE_STORAGE_LOADER
                and (module, name) in mcore_compat.storage_loader_globals()):
            return _storage_from_bytes  # megatron-core 0.19's name for it (mcore_compat), where it exists
        if "." not in name and name in _EXTRA_STATE_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if "." not in name and module == _TE_RECIPE_MODULE:
            obj = super().find_class(module, name)  # TE is installed where its checkpoints are loaded
            if isinstance(obj, type) and obj.__module__ == module and (
                    dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum | tuple)):
                return obj
        raise pickle.UnpicklingError(f"names {module}.{name}")


def screen_extra_state(obj: Any, where: str) -> None:
    """Screen the pickles inside the uint8 tensors of an ``_extra_state`` object (a list, as Megatron
    stores it, or the tensor itself); an empty tensor (TE without FP8) holds none.

    Raises:
        InputError: a pickle names anything but tensors, containers and TE's recipe types.
    """
    items = obj if isinstance(obj, list | tuple) else [obj]
    for t in items:
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.numel() > 0):
            continue
        try:
            _ExtraStateUnpickler(io.BytesIO(t.detach().cpu().numpy().tobytes())).load()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{where}: refused, its extra-state pickle {first[:160]} (Transformer Engine "
                             "would unpickle it without restriction); see docs/security.md") from None


def screen_checkpoint(path: Path) -> None:
    """Check every pickle of the checkpoint folder ``path`` before torch or Megatron loads it.

    Covers the ``*.pt`` files (Megatron's common state, sharded objects, old RNG files), the ``.metadata``
    pickle and the bytes items inside the ``*.distcp`` shards; a manifest, present or not, changes nothing.

    Raises:
        InputError: one file or item is refused or unreadable (the message names it).
    """
    for pt in sorted(path.rglob("*.pt")):
        obj = _load_plain_pt(pt)
        if "_extra_state" in pt.name:  # Megatron's older layout: a sharded object per file
            screen_extra_state(obj, str(pt))
    meta = path / ".metadata"
    if meta.exists():
        screen_bytes_items(path, read_dcp_metadata(meta))
    elif any(path.glob("*.distcp")):  # torch would fail later with a traceback; say it now
        raise InputError(f"{path}: its *.distcp shards have no .metadata next to them")


def screen_checkpoint_once(path: Path) -> None:
    """:func:`screen_checkpoint` on rank 0 of the default group, its verdict broadcast: every rank raises
    the same one-line ``InputError`` or none does.

    A collective (call it where every rank of the default group loads ``path``). Each rank screening
    itself would read every bytes item of every shard on every rank: thousands of small reads times
    thousands of ranks on a shared filesystem, for one verdict. Without a process group (or with one
    rank) it is the plain screen.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        screen_checkpoint(path)
        return
    from megatron_maspo.parallel import comm

    verdict: str | None = None
    if dist.get_rank() == 0:
        try:
            screen_checkpoint(path)
        except InputError as e:
            verdict = str(e)
        except Exception as e:  # tell the other ranks before failing, or they wait in the broadcast
            verdict = f"{path}: the screen failed ({type(e).__name__}: {str(e)[:160]})"
    verdict = comm.broadcast_object(verdict, src=0)
    if verdict is not None:
        raise InputError(verdict)
