"""NeMo-Run executors and tasks for ``maspo launch`` (the only module that imports ``nemo_run``).

The task is ``torchrun ... -m megatron_maspo.cli.main train --config <resolved config.yaml>`` (on Slurm
with ``--launcher srun``: one ``python -m ...`` per rank, no torchrun): a
``run.Script`` with ``m=True`` rather than a ``run.Partial``, so the training processes never import
nemo_run or fiddle, and the config travels as the YAML file :func:`job.write_config` wrote.

Traps handled here (cpu-notes.md §5): ``leptonai>=0.47`` breaks ``import nemo_run`` (pinned in the
``launch`` extra); the default GitArchivePackager needs a git checkout, so a plain ``run.Packager`` is used
(the package is installed in the container); with the torchrun launcher nemo-run requests one Slurm task
per node and torchrun spawns ``gpus_per_node`` workers; any script that calls :func:`launch` must guard
its entry with ``if __name__ == "__main__":`` (nemo-run re-executes ``__main__`` in local task processes);
a LocalTunnel submits the sbatch script from its own job_dir, which must be the Experiment's
``<base_dir>/experiments`` (anything else leaves the script where sbatch does not look), and nemo-run
rewrites ``/nemo_run`` inside its job paths, so the Slurm experiment folder is ``<job root>/nemorun``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from megatron_maspo.launch.job import (
    TRAIN_MODULE,
    LaunchOptions,
    job_env,
    job_root,
    nemo_run_dir,
)
from megatron_maspo.launch.requeue import REQUEUE_ENV
from megatron_maspo.launch.slurm_job import JobRecord, write_record
from megatron_maspo.parallel.slurm_ranks import SRUN_RANKS_ENV

try:
    import nemo_run as run
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("NeMo-Run cannot be imported; install the launch extra: pip install 'megatron-maspo[launch]' "
                      f"(nemo-run==0.11.1 with leptonai<0.47); import failed with: {e}") from e

logger = logging.getLogger(__name__)


def build_executor(opts: LaunchOptions, *, cuda: bool = True) -> run.Executor:
    """A LocalExecutor or SlurmExecutor running torchrun with ``opts.gpus_per_node`` workers per node.

    Args:
        opts: launch options (validated).
        cuda: add the GPU environment defaults (False for CPU-only local runs).
    """
    env = job_env(opts, cuda=cuda and not opts.cpu)
    if opts.executor == "local":
        launcher = run.Torchrun(rdzv_port=opts.master_port)
        # Task processes must import this package from the same tree as the launcher.
        root = str(Path(__file__).resolve().parents[2])
        env.setdefault("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        return run.LocalExecutor(ntasks_per_node=opts.gpus_per_node, launcher=launcher, env_vars=env)
    return _slurm_executor(opts, env)


def _slurm_executor(opts: LaunchOptions, env: dict[str, str]) -> run.SlurmExecutor:
    """sbatch + srun: torchrun per node, or one srun task per rank (``opts.launcher == "srun"``).

    Without a container the tasks run this checkout with the launcher's interpreter (``opts.python``),
    so the job directory, the checkout and the interpreter must be visible on the nodes at the same path.
    Jobs are requeueable (nemo-run's sbatch command line always says ``--requeue``; the script says so
    too), run with ``checkpoint.auto_resume`` (:func:`job.resolve_for_cluster`), and get
    ``--signal=USR1@lead``: the trainer checkpoints on it, then requeues the job if steps remain.
    """
    root = str(job_root(opts))
    container = opts.container_image is not None
    if container:
        # The job root (resolved config, run directory) is mounted at the same path inside the container.
        mounts = list(dict.fromkeys([*opts.container_mounts, f"{root}:{root}"]))
        # nemo-run's default workdir (/nemo_run/code) is empty with a plain Packager; srun honours the
        # last --container-workdir, and srun_args come after nemo-run's own flags.
        srun_args = [f"--container-workdir={root}"]
    else:
        mounts, srun_args = [], [f"--chdir={root}"]
        checkout = str(Path(__file__).resolve().parents[2])
        env.setdefault("PYTHONPATH", _prepend(checkout, os.environ.get("PYTHONPATH")))
        # `python` / `torchrun` resolve to the launcher's interpreter (its venv's bin first on PATH).
        bin_dir = str(Path(opts.python or sys.executable).parent)
        env.setdefault("PATH", _prepend(bin_dir, os.environ.get("PATH")))
    setup = []
    if opts.launcher == "srun":
        # Every task is a rank: torch.distributed's variables come from SLURM_PROCID & co. (parallel/slurm_ranks.py).
        setup.append(f"export MASTER_ADDR=${run.SlurmExecutor.HEAD_NODE_IP_VAR} MASTER_PORT={opts.master_port} "
                     f"{SRUN_RANKS_ENV}=1")
    env[REQUEUE_ENV] = "1"
    return run.SlurmExecutor(
        account=opts.account, partition=opts.partition, time=opts.time, nodes=opts.nodes,
        ntasks_per_node=opts.gpus_per_node, gpus_per_node=None if opts.cpu else opts.gpus_per_node,
        container_image=opts.container_image, container_mounts=mounts, env_vars=env,
        exclusive=True, packager=run.Packager(), job_name_prefix="maspo-",
        launcher=run.Torchrun(rdzv_port=opts.master_port) if opts.launcher == "torchrun" else None,
        signal=f"USR1@{opts.signal_lead_s}" if opts.signal_lead_s else None,
        additional_parameters={"requeue": True}, setup_lines="\n".join(setup) or None,
        # sbatch runs the script from the tunnel's job_dir: the experiments folder of _experiment().
        srun_args=srun_args, tunnel=run.LocalTunnel(job_dir=str(nemo_run_dir(opts) / "experiments")),
        poll_estimated_start_time=False,
    )


def _experiment(opts: LaunchOptions, executor: run.Executor) -> run.Experiment:
    """Slurm experiments (sbatch script, batch and task logs) live under the job root, next to the run
    directory on the shared filesystem; local ones in $NEMORUN_HOME."""
    base = str(nemo_run_dir(opts)) if opts.executor == "slurm" else None
    return run.Experiment(opts.name, executor=executor, log_level="WARN", base_dir=base)


def _prepend(entry: str, path_list: str | None) -> str:
    """``entry`` first in an os.pathsep list, without a duplicate of it further on."""
    rest = [p for p in (path_list or "").split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry, *rest])


def build_task(args: list[str], module: str = TRAIN_MODULE) -> run.Script:
    """``python -m <module> <args...>`` as a NeMo-Run script task (torchrun prepends its own flags)."""
    return run.Script(path=module, args=list(args), entrypoint="python", m=True)


def dry_run_script(opts: LaunchOptions, task: run.Script, *, cuda: bool = True) -> str:
    """The job script NeMo-Run would submit (the sbatch script on Slurm, the command locally); submits
    nothing. The experiment folder NeMo-Run prepares for the dry run is deleted again."""
    with _experiment(opts, build_executor(opts, cuda=cuda)) as exp:
        exp.add(task, name=opts.name)
        exp.dryrun(log=False)
        info = getattr(exp.jobs[0], "_dryrun_info", None)
    if info is None:  # pragma: no cover - guards a nemo-run internal
        raise RuntimeError("nemo-run produced no dry-run info; check the installed nemo-run version (0.11.1)")
    return str(info)


def launch(opts: LaunchOptions, task: run.Script, *, cuda: bool = True, run_dir: str = "") -> JobRecord | None:
    """Run ``task`` locally (blocks until it ends) or submit it to Slurm (returns once queued).

    Returns:
        None locally; on Slurm the job's record (id, log folder), also written to ``<job root>/slurm_job.json``
        for ``maspo launch --status / --logs``.

    Raises:
        RuntimeError: a local run did not succeed, or sbatch returned no job id.
    """
    executor = build_executor(opts, cuda=cuda)
    local = opts.executor == "local"
    with _experiment(opts, executor) as exp:
        exp.add(task, name=opts.name, tail_logs=local)
        exp.run(detach=not local)
    # Leaving the context waited for a local job; its final state is on the job object.
    job = exp.jobs[0]
    state = job.state
    name = getattr(state, "name", str(state))
    if local:
        if name != "SUCCEEDED":
            raise RuntimeError(f"launch {opts.name!r} ended in state {name}; logs under {exp._exp_dir}")
        logger.info("launch %r: %s (experiment folder %s)", opts.name, name, exp._exp_dir)
        return None
    # The handle ends in the Slurm job id (slurm_tunnel://nemo_run/<id>).
    job_id = str(job.handle or "").rsplit("/", 1)[-1]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch returned no job id (handle {job.handle!r}); see {exp._exp_dir}")
    record = JobRecord(job_id=job_id, log_dir=str(job.executor.job_dir), run_dir=run_dir)
    write_record(job_root(opts), record)
    return record
