"""Hostile checkpoint files for the screen's tests: pickles that run ``os.system`` and leave a marker.

A test plants one, runs the real reader or command, and asserts the marker file was never created
(the proof that no code ran) and the refusal named the file.
"""

from __future__ import annotations

import os
import pickle
import shlex
from pathlib import Path


class _System:
    """Pickles as a call of ``os.system`` (``posix.system``) that touches ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def system_pickle(marker: Path) -> bytes:
    """A plain pickle that runs ``touch marker`` through ``os.system`` when unpickled."""
    return pickle.dumps(_System(marker), protocol=2)


def system_object(marker: Path) -> _System:
    """The object to ``torch.save`` into a ``*.pt`` file (the same ``os.system`` call)."""
    return _System(marker)


def plant_in_bytes_item(folder: Path, marker: Path) -> tuple[Path, str]:
    """Overwrite the first bytes item of ``folder``'s ``*.distcp`` shards with :func:`system_pickle`.

    Torch's reader hands a bytes item to ``torch.load(weights_only=False)``, which unpickles a non-zip
    stream's first object (its "magic number") without restriction: the pickle, zero-padded to the item's
    length, is all it takes. The offsets stay valid, so the ``.metadata`` needs no change.

    Returns:
        the shard file and the item's key.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(folder)).read_metadata()  # our own freshly written checkpoint
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            payload = system_pickle(marker)
            assert len(payload) <= info.length, (len(payload), info.length)
            shard = folder / info.relative_path
            with open(shard, "r+b") as f:
                f.seek(info.offset)
                f.write(payload + b"\0" * (info.length - len(payload)))
            return shard, index.fqn
    raise AssertionError(f"{folder}: no bytes item to plant in")


def replace_bytes_item(folder: Path, key: str, payload: bytes) -> Path:
    """Store ``payload`` as the bytes item ``key`` of ``folder`` in a shard file of its own, and rewrite the
    ``.metadata`` to point there (what anyone handing over a checkpoint can do). Returns the new shard."""
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()  # our own freshly written checkpoint
    index = next(i for i in md.storage_data if i.fqn == key)
    shard = folder / f"__planted_{len(list(folder.glob('__planted_*')))}.distcp"
    shard.write_bytes(payload)
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path=shard.name, offset=0,
                                                 length=len(payload))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return shard
