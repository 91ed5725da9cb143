"""Atomic Megatron distributed checkpoints of the actor: model, optimizer, LR schedule, RNG, data.

Layout of ``<root>/step_<N>/`` (written as ``<root>/.tmp_step_<N>.<random>`` then renamed by rank 0, so
a directory named ``step_*`` is always complete; the random part keeps two runs, or a run and the
leftover of a killed one, out of each other's temp folder, and leftovers are removed at the next commit):

* Megatron ``torch_dist`` shards of ``{"model": ..., "optimizer": ...}`` (resharded on load: a
  checkpoint written at one TP/PP loads at another), plus the common (rank-0) items ``scheduler``,
  ``data_state`` (the trainer's opaque dict) and ``steps_done``;
* ``rng/rank<r>.safetensors``: CPU/CUDA and Megatron tracker RNG states, restored only when the world
  size is unchanged (otherwise there is no meaningful mapping; logged). Older checkpoints' ``rank<r>.pt``
  is read with ``weights_only=True``; every pickle is screened before loading (``model/safe_load.py``).

``keep_last`` older complete checkpoints are removed by rank 0 after the new one is in place.
Distributed-optimizer state uses ``fully_reshardable`` sharding (cpu-notes.md §3), memory-efficient
where the gloo data-parallel groups exist (the trainer creates them with the distributed optimizer):
``distrib_optim_fully_reshardable_mem_efficient`` gathers the fp32 master copies and both Adam moments
over gloo onto DP rank 0 only. Without it megatron-core 0.16.1 all-gathers them (NCCL) onto *every* DP
rank's CPU (``get_parameter_state_dp_zero(return_on_all_ranks=True)``): 12 bytes per local parameter on
every rank, ~46 GB per rank for 7B at TP 2, at every save. Both write the same canonical tensors (the
load reads either). Loading still builds the whole canonical state on every rank (megatron-core's
``empty_data`` path), once per resume.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from megatron_maspo.model.checkpoint import (
    collective_atomic_dir,
    load_model_state,
    model_sharded_state_dict,
)
from megatron_maspo.model.ckpt_manifest import (
    disk_full,
    full_disk_error,
    list_checkpoints,
    write_manifest,
)
from megatron_maspo.model.safe_load import load_rng, save_rng, screen_checkpoint_once
from megatron_maspo.model.spec_record import spec_mismatch, write_spec_record
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.parallel.orphans import prepare_child_processes

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_metadata(optimizer: Any) -> dict:
    """``sharded_state_dict`` metadata: ``fully_reshardable``, memory-efficient when every distributed
    optimizer inside has its gloo data-parallel group (it gathers over it)."""
    dist_opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
                 if hasattr(o, "data_parallel_group_gloo")]
    mem_efficient = bool(dist_opts) and all(o.data_parallel_group_gloo is not None for o in dist_opts)
    return {**_OPT_METADATA, "distrib_optim_fully_reshardable_mem_efficient": mem_efficient}


def _sharded_state(actor: Any, *, is_loading: bool, with_optimizer: bool) -> dict:
    model_sd = model_sharded_state_dict(actor.named_modules_unwrapped())
    state: dict = dict(model_sd)
    if with_optimizer:
        state["optimizer"] = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=optimizer_metadata(actor.optimizer))
    return state


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if on_cuda() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["cpu"])
    if st["cuda"] is not None and on_cuda():
        torch.cuda.set_rng_state(st["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(st["tracker"])


def save_checkpoint(actor: Any, root: str | Path, step: int, *, data_state: dict | None = None,
                    keep_last: int = 2) -> Path:
    """Collectively save the actor's training state as ``<root>/step_<step>``; returns the path."""
    if hasattr(actor, "require_resident"):
        actor.require_resident()  # an offloaded storage would be written as empty: refuse, lose nothing
    prepare_child_processes()  # Megatron's writer processes and their Manager die with this process
    root = Path(root)
    final = root / f"step_{step}"

    def prune() -> None:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for left in root.glob(".tmp_step_*"):  # a killed run's partial saves (the run lock: none is live)
            shutil.rmtree(left, ignore_errors=True)

    previous = (list_checkpoints(root) or [None])[-1]
    try:
        with collective_atomic_dir(final, overwrite=True, tmp_name=f".tmp_step_{step}.{uuid.uuid4().hex[:8]}",
                                   on_commit=prune) as tmp:
            state = _sharded_state(actor, is_loading=False, with_optimizer=True)
            state.update(scheduler=actor.scheduler.state_dict(), data_state=dict(data_state or {}),
                         steps_done=actor.steps_done, world_size=dist.get_world_size())
            dist_checkpointing.save(state, str(tmp))
            if dist.get_rank() == 0 and hasattr(actor, "opts"):  # the spec that built it (model/spec_record.py)
                write_spec_record(tmp, actor.opts)
            (tmp / "rng").mkdir(exist_ok=True)
            save_rng(_rng_state(), tmp / "rng" / f"rank{dist.get_rank()}.safetensors")
            comm.barrier()  # every rank's files are in place before rank 0 lists them
            if dist.get_rank() == 0:
                write_manifest(tmp)  # sizes and checksums, verified before a resume
    except BaseException as e:  # torch's CheckpointException is a BaseException
        # the temp folder is gone, the previous checkpoint untouched: say so in one line
        if not isinstance(e, KeyboardInterrupt | SystemExit) and disk_full(e):
            raise full_disk_error(final, previous) from None
        raise
    logger.info("saved checkpoint %s", final)
    return final


def _fix_dist_optimizer_after_load(optimizer: Any) -> None:
    """Give each Adam state its own ``step`` tensor (Megatron's no-TE load shares one object)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            if "step" in st and torch.is_tensor(st["step"]):
                st["step"] = st["step"].clone()


@contextlib.contextmanager
def _fully_reshardable_step_compat():
    """megatron-core 0.16.1 without Apex/TE: torch Adam keeps a ``step`` per parameter state, which the
    ``fully_reshardable`` loader copies into from the checkpoint tensors, which have none (``step`` comes
    from the param groups): ``KeyError: 'step'`` on every distributed-optimizer resume. Inside the block
    only the keys the checkpoint provides are copied (``step`` is then set by Megatron's loader)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_present(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, src in tensors.items():
            dst[key].copy_(src)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_present
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = orig


def load_checkpoint(actor: Any, path: str | Path, *, load_optimizer: bool = True) -> dict:
    """Collectively load a checkpoint written by :func:`save_checkpoint` (any TP/PP layout).

    Returns:
        the trainer's ``data_state`` dict.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    screen_checkpoint_once(path)  # no pickle from a checkpoint runs code (a one-line refusal naming the file)
    mismatch = spec_mismatch(path, actor.opts) if hasattr(actor, "opts") else None
    if mismatch:  # Megatron maps most keys across specs; say so now, and name both if the load fails
        logger.warning("%s", mismatch)
    if load_optimizer:
        for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if init is not None:  # torch Adam creates state lazily: give the loader targets
                init()
    state = _sharded_state(actor, is_loading=True, with_optimizer=load_optimizer)
    try:
        loaded = dist_checkpointing.load(state, str(path))
        load_model_state(actor.named_modules_unwrapped(), loaded)
    except Exception as e:
        if mismatch:
            raise ValueError(f"{mismatch} (load failed: {e})") from e
        raise
    if load_optimizer:
        # Megatron's param groups carry their own max_lr / min_lr, which the scheduler reads before its
        # own; the optimizer state would bring back the checkpoint's. Keep this run's (the config's).
        limits = [(g.get("max_lr"), g.get("min_lr")) for g in actor.optimizer.param_groups]
        with _fully_reshardable_step_compat():
            actor.optimizer.load_state_dict(loaded["optimizer"])
        _fix_dist_optimizer_after_load(actor.optimizer)
        for g, (max_lr, min_lr) in zip(actor.optimizer.param_groups, limits, strict=True):
            if max_lr is not None:
                g["max_lr"], g["min_lr"] = max_lr, min_lr
        _load_scheduler(actor.scheduler, loaded["scheduler"])
    actor.steps_done = int(loaded["steps_done"])
    rng = load_rng(path / "rng", dist.get_rank())
    if int(loaded["world_size"]) == dist.get_world_size() and rng is not None:
        _set_rng_state(rng)
    else:
        logger.info("checkpoint world size %s != %s: RNG state not restored", loaded["world_size"],
                    dist.get_world_size())
    return dict(loaded["data_state"])


def scheduler_changes(config_sd: dict, checkpoint_sd: dict) -> dict[str, tuple]:
    """``{name: (checkpoint value, config value)}`` for every schedule setting that differs (the step
    count ``num_steps`` is progress, not a setting, and is left out)."""
    return {k: (checkpoint_sd[k], v) for k, v in config_sd.items()
            if k != "num_steps" and k in checkpoint_sd and checkpoint_sd[k] != v}


def _load_scheduler(scheduler: Any, checkpoint_sd: dict) -> None:
    """Restore the schedule's progress; its settings come from this run's config.

    Megatron's scheduler keeps the checkpoint's lr, warmup and decay horizon by default, so a resume
    with ``--set optim.lr=...`` (or a longer ``train.steps``) would silently train at the old values.
    The config wins instead, and each changed setting is logged.
    """
    changed = scheduler_changes(scheduler.state_dict(), checkpoint_sd)
    if changed:
        logger.warning("resuming with the config's learning-rate schedule, not the checkpoint's: %s",
                       ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    scheduler.load_state_dict(checkpoint_sd)
