"""One rank of a full-size layout, in this process, on the meta device: Megatron's real model, no memory.

How a rank of a ``world``-GPU job is reproduced without spawning the world:

* **process groups**: ``torch.distributed`` is initialised with PyTorch's ``fake`` backend
  (``torch.testing._internal.distributed.fake_pg``: every collective returns at once, no peer exists) at
  the rank's global index and the job's world size, so ``initialize_model_parallel`` builds the same TP /
  PP / EP / DP groups, sizes and ranks as on the cluster and the model layers read them as usual
  (megatron-core 0.16.1 sizes its layers from the groups, ``get_pg_size``, not from the ``set_*``
  overrides). Gloo groups are not created (``create_gloo_process_groups=False``): the fake backend has no
  transport for them and building the model needs none.
* **meta device**: a ``TorchFunctionMode`` sends every factory call to ``device="meta"`` (Megatron passes
  ``device=torch.cuda.current_device()`` explicitly with ``use_cpu_initialization=False``, which a
  ``torch.device("meta")`` context alone would not override), so parameters have shapes and dtypes and no
  storage; a 70B stage costs a few hundred MB of Python objects.
* **coordinates**: ranks are ordered by Megatron's ``RankGenerator`` (order ``tp-cp-ep-dp-pp``); ranks
  with the same (tp, pp, ep, cp) coordinate build identical chunks (data-parallel replicas), so one is
  built per distinct coordinate, the lowest global rank holding it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_maspo.parallel.device import install_cpu_bench


@dataclass(frozen=True)
class Coordinate:
    """A model-parallel position; every rank with the same one holds the same shapes."""

    tp: int
    pp: int
    ep: int
    cp: int
    rank: int
    """The lowest global rank at this coordinate (the one that is built)."""


def coordinates(world: int, *, tp: int, pp: int, ep: int, cp: int = 1) -> list[Coordinate]:
    """One :class:`Coordinate` per distinct (tp, pp, ep, cp) position of a ``world``-rank job, ordered by rank.

    Raises:
        ValueError: the sizes do not divide ``world``.
    """
    from megatron.core.parallel_state import RankGenerator

    if world % (tp * pp * cp) or world % (pp * ep):
        raise ValueError(f"world {world} is not divisible by tp*pp*cp={tp * pp * cp} and pp*ep={pp * ep}")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    # experts are not split over TP (expert_tensor_parallel_size=1, parallel/groups.py): the expert
    # layout is ETP 1 x EP x expert-DP x PP over the same ranks
    expert = RankGenerator(tp=1, ep=ep, dp=world // (pp * ep), pp=pp, cp=1, order="tp-cp-ep-dp-pp")

    def position(gen: RankGenerator, name: str) -> dict[int, int]:
        return {r: i for group in gen.get_ranks(name) for i, r in enumerate(group)}

    tp_of, pp_of, cp_of, ep_of = (position(dense, "tp"), position(dense, "pp"), position(dense, "cp"),
                                  position(expert, "ep"))
    seen: dict[tuple[int, int, int, int], int] = {}
    for r in range(world):
        seen.setdefault((tp_of[r], pp_of[r], ep_of[r], cp_of[r]), r)
    return [Coordinate(*key, rank=r) for key, r in sorted(seen.items(), key=lambda kv: kv[1])]


class MetaDevice(TorchFunctionMode):
    """Every tensor factory inside lands on the meta device, whatever ``device=`` it was given."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_rank(world: int, coord: Coordinate, *, tp: int, pp: int, ep: int, cp: int = 1,
              vpp: int | None = None) -> Iterator[None]:
    """Megatron's parallel state of global rank ``coord.rank`` in a ``world``-rank job, inside the block.

    Refuses to run inside a real distributed job (it replaces the default process group).

    Raises:
        RuntimeError: ``torch.distributed`` is already initialised, or Megatron derived another coordinate
            than :func:`coordinates` did (the two orderings disagree).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("maspo check builds fake ranks and must run outside a distributed job")
    install_cpu_bench()  # CPU only (a no-op with CUDA)
    dist.init_process_group("fake", store=FakeStore(), rank=coord.rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                     create_gloo_process_groups=False)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        got = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
               ps.get_expert_model_parallel_rank(), ps.get_context_parallel_rank())
        if got != (coord.tp, coord.pp, coord.ep, coord.cp):
            raise RuntimeError(f"rank {coord.rank}: Megatron's coordinate {got} != the check's "
                               f"{(coord.tp, coord.pp, coord.ep, coord.cp)}")
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def build_meta_chunks(spec, opts, pp_rank: int) -> list[torch.nn.Module]:
    """``provider.build_model_chunks`` on the meta device (inside :func:`fake_rank`)."""
    from megatron_maspo.model.provider import build_model_chunks

    with torch.device("meta"), MetaDevice():
        return build_model_chunks(spec, opts, pp_rank=pp_rank)
