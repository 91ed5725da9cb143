"""Checkpoint pickles are screened, never run: crafted ``*.pt`` and ``.metadata`` files are refused in one
line naming the file, and the RNG state round-trips through safetensors (real torch files, no mocks)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from megatron_maspo.errors import InputError
from megatron_maspo.model.safe_load import load_rng, save_rng, screen_checkpoint, screen_metadata


class _Evil:
    """Unpickling this creates ``marker``: the proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": None,
            "tracker": {"model-parallel-rng": torch.get_rng_state()}}


def test_rng_round_trips_through_safetensors(tmp_path):
    st = _rng_state()
    save_rng(st, tmp_path / "rank0.safetensors")
    back = load_rng(tmp_path, 0)
    assert torch.equal(back["cpu"], st["cpu"]) and back["cuda"] is None
    assert torch.equal(back["tracker"]["model-parallel-rng"], st["cpu"])
    assert load_rng(tmp_path, 1) is None  # another rank's file is absent: nothing to restore


def test_an_old_plain_rng_pt_still_loads(tmp_path):
    torch.save(_rng_state(), tmp_path / "rank0.pt")
    assert torch.equal(load_rng(tmp_path, 0)["cpu"], torch.get_rng_state())


@pytest.mark.parametrize("name", ["rng/rank0.pt", "common.pt"])
def test_a_code_running_pt_is_refused_without_running(tmp_path, name):
    marker = tmp_path / "ran"
    (tmp_path / "rng").mkdir()
    torch.save({"x": _Evil(marker)}, tmp_path / name)
    with pytest.raises(InputError) as e:
        screen_checkpoint(tmp_path)
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / name) in msg and "refused" in msg, msg
    if name.startswith("rng"):
        with pytest.raises(InputError, match="rank0.pt"):
            load_rng(tmp_path / "rng", 0)
        assert not marker.exists()


def test_a_real_dcp_metadata_passes_and_a_crafted_one_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.randn(3, 4), "n": torch.tensor(3), "extra": b"bytes"},
                 checkpoint_id=str(tmp_path / "ok"))
    screen_checkpoint(tmp_path / "ok")  # what torch writes is accepted
    marker = tmp_path / "ran"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(InputError, match=r"\.metadata: refused, its pickle names io\.open"):
        screen_metadata(bad / ".metadata")
    assert not marker.exists()
    # a dotted name reaching through a torch module to os.system is refused too
    (bad / ".metadata").write_bytes(
        b"\x80\x04\x8c%torch.distributed.checkpoint.filesystem\x94\x8c\tos.system\x94\x93\x94.")
    with pytest.raises(InputError, match="refused"):
        screen_metadata(bad / ".metadata")


def _dcp_with_bytes(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.randn(3, 4).bfloat16(), "extra": [None], "opt": torch.zeros(2)},
                 checkpoint_id=str(folder))


def test_a_code_running_bytes_item_in_a_shard_is_refused_without_running(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.hostile import plant_in_bytes_item

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _dcp_with_bytes(ckpt)
    screen_checkpoint(ckpt)  # the clean one passes
    shard, key = plant_in_bytes_item(ckpt, marker)
    with pytest.raises(InputError) as e:
        screen_checkpoint(ckpt)
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{shard}: bytes item {key!r}: refused"), msg
    # the plant is a real attack: torch's own reader runs it (what every resume did before the screen)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.warns(UserWarning, match="single process"), pytest.raises(CheckpointException, match="magic"):
        dcp.load({"extra": None}, checkpoint_id=str(ckpt))  # the code runs, then torch fails
    assert marker.exists()


def test_metadata_naming_a_shard_outside_the_folder_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _dcp_with_bytes(ckpt)
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw.replace(b"__0_0.distcp", b"../_0.distcp"))  # same length
    with pytest.raises(InputError, match="outside the checkpoint folder"):
        screen_checkpoint(ckpt)


def test_the_conversion_dtype_probe_reads_metadata_through_the_screen(tmp_path):
    from megatron_maspo.conversion.jobs import megatron_checkpoint_dtype
    from tests.hostile import system_pickle

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _dcp_with_bytes(ckpt)
    assert megatron_checkpoint_dtype(ckpt) == torch.float32  # w bf16, opt fp32: the widest one
    (ckpt / ".metadata").write_bytes(system_pickle(marker))
    with pytest.raises(InputError, match=r"\.metadata: refused, its pickle names posix\.system"):
        megatron_checkpoint_dtype(ckpt)
    assert not marker.exists()


def test_reader_and_writer_classes_of_torch_checkpoint_modules_are_refused(tmp_path):
    # FileSystemWriter is defined in an allowed module but is neither a dataclass nor an enum
    from torch.distributed.checkpoint import FileSystemWriter

    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps(FileSystemWriter, protocol=4))  # a reference to the class
    with pytest.raises(InputError, match="names torch.distributed.checkpoint.filesystem.FileSystemWriter"):
        screen_metadata(bad)


def _te_extra_state(state: object) -> torch.Tensor:
    """What Transformer Engine's ``get_extra_state`` returns: a plain pickle in a uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _as_megatron_object(data: object) -> bytes:
    """A bytes item as Megatron's torch_dist strategy writes a ShardedObject: the torch.save of [data]."""
    out = io.BytesIO()
    torch.save([data], out)
    return out.getvalue()


def test_a_te_extra_state_pickle_is_screened_inside_its_bytes_item(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.hostile import replace_bytes_item, system_object

    marker = tmp_path / "ran"
    good = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(2, 3), "extra_fp8_variables": {"n": 1}}
    key = "linear_qkv._extra_state/shard_0_1"
    for name, state in (("ok", good), ("bad", {"scale_fwd": system_object(marker)})):
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({key: b"placeholder", "empty._extra_state": b"placeholder"},
                     checkpoint_id=str(tmp_path / name))
        replace_bytes_item(tmp_path / name, "empty._extra_state",
                           _as_megatron_object(torch.empty(0, dtype=torch.uint8)))
        shard = replace_bytes_item(tmp_path / name, key, _as_megatron_object(_te_extra_state(state)))
    screen_checkpoint(tmp_path / "ok")  # tensors, a dict, an empty tensor (TE without FP8): accepted
    with pytest.raises(InputError) as e:
        screen_checkpoint(tmp_path / "bad")
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{shard}: bytes item {key!r}: refused, its extra-state "
                                              "pickle names posix.system"), msg
    # the plant is real: TE's set_extra_state does pickle.loads on these bytes
    pickle.loads(_te_extra_state({"scale_fwd": system_object(marker)}).numpy().tobytes())
    assert marker.exists()
