"""Check an HF folder against the tensor table of its architecture before any rank starts.

Only safetensors headers are read (8-byte length + JSON: name -> dtype, shape, byte range), so the
check costs milliseconds whatever the checkpoint size, and it catches what would otherwise fail
inside every spawned rank: a truncated file, a missing / unexpected / misshaped tensor, a tensor of
a non-floating dtype, a shard the index names but the folder lacks. Each failure is an
:class:`~megatron_maspo.errors.InputError` whose one-line message names the file and the tensor.

Layout of a safetensors file: ``u64 n`` (little endian), ``n`` bytes of JSON header, then the data
area; each tensor's ``data_offsets = [begin, end]`` are relative to the start of the data area.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_maspo.conversion.plan import hf_shape, hf_state_dict_keys
from megatron_maspo.errors import InputError
from megatron_maspo.model.spec import ArchSpec

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""Header dtypes the converter reads as weights."""

_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def safetensors_files(folder: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of an HF folder and, when there is an index, its ``tensor -> file`` map.

    Raises:
        InputError: an unreadable index, no ``*.safetensors`` file, or a shard the index names that
            the folder lacks.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                some = next(k for k, v in weight_map.items() if v == f.name)
                raise InputError(f"{f}: missing; {index.name} maps tensor {some!r} to it")
        return files, dict(weight_map)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in HF folder {folder}")
    return files, None


def read_header(path: str | Path) -> dict[str, dict]:
    """``{tensor: {"dtype", "shape", "data_offsets"}}`` of one safetensors file, checked for size.

    Raises:
        InputError: the file is too short for its header or for any tensor's bytes (naming the
            first tensor cut off), or the header is not valid safetensors JSON.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise InputError(f"{path}: truncated or not a safetensors file (header of {n} bytes, file of "
                             f"{size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in sorted(header.items(), key=lambda kv: _end(kv[1])):
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape, dtype = tuple(int(x) for x in info["shape"]), str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if end > data:
            raise InputError(f"{path}: truncated: tensor {name!r} needs bytes up to {8 + n + end}, the "
                             f"file has {size}")
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": (begin, end)}
    return header


def _end(info: object) -> int:
    try:
        return int(info["data_offsets"][1])  # type: ignore[index]
    except (KeyError, TypeError, ValueError, IndexError):
        return -1


def validate_hf_folder(folder: str | Path, spec: ArchSpec) -> None:
    """Names, shapes, dtypes and file sizes of ``folder``'s safetensors vs the tensor table of ``spec``.

    Raises:
        InputError: the first problem found, as one line naming the file and the tensor.
    """
    files, weight_map = safetensors_files(folder)
    where: dict[str, Path] = {}
    meta: dict[str, dict] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in where:
                raise InputError(f"{f}: tensor {name!r} is also in {where[name].name}")
            where[name], meta[name] = f, info
    expected = hf_state_dict_keys(spec)
    for name in expected:
        if name not in meta:
            holder = folder_or_file(folder, files, weight_map, name)
            raise InputError(f"{holder}: missing tensor {name!r} (the {spec.family} layout of "
                             f"config.json needs it)")
        info, want = meta[name], hf_shape(name, spec)
        if info["shape"] != want:
            raise InputError(f"{where[name]}: tensor {name!r} has shape {info['shape']}, config.json "
                             f"implies {want}")
        if info["dtype"] not in FLOAT_DTYPES:
            raise InputError(f"{where[name]}: tensor {name!r} has dtype {info['dtype']}; accepted: "
                             f"{sorted(FLOAT_DTYPES)}")
    from megatron_maspo.conversion.passthrough import passthrough_keys

    extra = sorted(set(meta) - set(expected) - set(passthrough_keys(spec, meta)))  # MTP layers: kept by name
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise InputError(f"{where[extra[0]]}: unexpected tensor {extra[0]!r}{more} for the {spec.family} "
                         "layout of config.json")


def folder_or_file(folder: str | Path, files: list[Path], weight_map: dict[str, str] | None,
                   name: str) -> Path:
    """Where a missing tensor should have been: the shard the index names, the only file, or the folder."""
    if weight_map and name in weight_map:
        return Path(folder) / weight_map[name]
    return files[0] if len(files) == 1 else Path(folder)
