"""The one place that initialises Megatron's parallel state and hands out explicit process groups.

Nothing outside this module calls ``megatron.core.parallel_state.get_*``: code receives a
:class:`ParallelGroups` and passes the group it needs (``tp_group``, ``dp_group``, ...) explicitly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_maspo.parallel.device import install_cpu_bench

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and ranks of this process in a TP x CP x DP x PP (x EP) layout.

    Megatron's rank order is tp-cp-ep-dp-pp (tensor fastest). ``dp_group`` is the data-parallel group
    without context parallelism (ranks that hold different samples); ``dp_cp_group`` spans DP x CP
    (ranks that hold different tokens: where token sums and gradients reduce); ``cp_group`` splits
    each packed row; ``embd_group`` ties the first and last pipeline stages.
    """

    tp: int
    pp: int
    dp: int
    ep: int
    vpp: int | None
    tp_group: Any
    pp_group: Any
    dp_group: Any
    dp_cp_group: Any
    ep_group: Any
    mp_group: Any
    embd_group: Any
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    cp: int = 1
    cp_group: Any = None
    cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (
            f"tp={self.tp_rank}/{self.tp} pp={self.pp_rank}/{self.pp} "
            f"dp={self.dp_rank}/{self.dp} ep={self.ep_rank}/{self.ep} cp={self.cp_rank}/{self.cp}"
        )


def validate_layout(world_size: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> int:
    """Return the data-parallel size of a layout, or raise ``ValueError`` naming the constraint.

    Experts are laid over the ranks of one pipeline stage (``tp·cp·dp`` of them), as in Megatron's
    expert grid, so ``ep`` divides ``dp·cp·tp``.
    """
    for name, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                    ("expert_model_parallel_size", ep), ("context_parallel_size", cp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {tp} * {pp} * {cp} = {tp * pp * cp}"
        )
    dp = world_size // (tp * pp * cp)
    if (dp * cp * tp) % ep != 0:
        raise ValueError(
            f"expert_model_parallel_size {ep} must divide data_parallel_size * "
            f"context_parallel_size * tensor_model_parallel_size = {dp} * {cp} * {tp}"
        )
    return dp


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: int | None = None,
    *,
    cp: int = 1,
    seed: int = 1234,
    cpu_compat: bool = True,
    gloo_groups: bool = False,
) -> ParallelGroups:
    """Initialise Megatron's parallel state on an already initialised default process group.

    Applies the CPU shims first when CUDA is absent (``cpu_compat``), then seeds Megatron's model-
    parallel RNG streams so TP ranks draw distinct dropout masks and identical replicated weights.

    Args:
        tp, pp, ep: tensor, pipeline and expert parallel sizes; DP is derived.
        cp: context-parallel size (each packed row split over ``cp`` ranks).
        vpp: virtual pipeline chunks per stage (None = no interleaving).
        seed: base seed for ``model_parallel_cuda_manual_seed``.
        cpu_compat: install :mod:`megatron_maspo.parallel.cpu_compat` when CUDA is absent.
        gloo_groups: also create Megatron's gloo data-parallel groups (DP, DP x CP, expert DP; Megatron
            creates them by default). Their only reader is the distributed optimizer's memory-efficient
            checkpoint save (``get_parameter_state_dp_zero(use_gloo_comm=True)``: the optimizer state is
            gathered on DP rank 0 over gloo, in host memory), so the trainer asks for them exactly when it
            uses the distributed optimizer; every other job (conversion, eval, tests) skips their TCP
            set-up (a full mesh per group over ``GLOO_SOCKET_IFNAME``'s interface). See
            :func:`gloo_groups_available`.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: the layout does not fit the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before init_parallel()")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    validate_layout(dist.get_world_size(), tp, pp, ep, cp)
    if cpu_compat:
        install_cpu_bench()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        # Experts are never split over TP (model/moe.py sets expert_tensor_parallel_size=1 in the config):
        # the expert-TP group must then be size 1 too, or the alltoall dispatcher gathers over TP.
        expert_tensor_parallel_size=1,
        context_parallel_size=cp,
        create_gloo_process_groups=gloo_groups,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = ParallelGroups(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        ep=ep,
        vpp=vpp,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep_group=ps.get_expert_model_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        # None on the middle stages of PP >= 3: they hold neither the embedding nor the head, so Megatron
        # puts them in no embedding group (its getter would assert)
        embd_group=ps.get_embedding_group(check_initialized=False),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        cp=cp,
        cp_group=ps.get_context_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
    )
    logger.debug("parallel state: %s", groups.describe())
    return groups


def gloo_groups_available() -> bool:
    """Whether Megatron's gloo data-parallel groups exist (``init_parallel(gloo_groups=True)``): the
    optimizer is then built with them and checkpoints use the memory-efficient optimizer save."""
    from megatron.core import parallel_state as ps

    return getattr(ps, "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", None) is not None


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state (the default process group is left alone)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
