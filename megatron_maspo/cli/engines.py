"""``maspo engines``: grow or shrink the rollout pool of a running job (supervised engines only).

    maspo engines add runs/maspo                  # one more engine, to the owner with the fewest
    maspo engines add runs/maspo --from-step 12 --owner 1 --gpus 6,7
    maspo engines drain runs/maspo --engine 2
    maspo engines list runs/maspo                 # the requests and what became of them

The job must run with ``rollout.placement=disaggregated`` and ``rollout.supervise_engines=true``. A
request is a file in ``RUN_DIR/engines/requests``; each owner of the rollout pool applies its own at the
next batch boundary of a step >= ``--from-step``: a new engine is started beside the owner (on its
node), sent the current weights whole, digest-checked, and takes a share of the owner's prompts from
that batch on; a drained one stops between batches, losing nothing. ``list`` shows the step each
request took effect at. The requests stay: a resumed job starts with the pool they describe.
(docs/engine-faults.md, "Elastic capacity").

Exit status: 0 when the request is written, 2 on bad input (no such run, a run without supervised
engines, an engine that is not in the pool).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("engines", help="add or drain rollout engines of a running job (supervised)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    add = verbs.add_parser("add", help="start one more engine in the running job")
    add.add_argument("run_dir", help="the job's checkpoint.run_dir")
    add.add_argument("--owner", type=int, default=None,
                     help="the pool engine whose supervisor runs it (default: the one with the fewest)")
    add.add_argument("--from-step", type=int, default=0, help="first step whose batch it may make (default: next)")
    add.add_argument("--gpus", default=None, help="its node-local GPUs, e.g. 6,7 (default: its owner's)")
    drain = verbs.add_parser("drain", help="stop one engine of the running job between two batches")
    drain.add_argument("run_dir", help="the job's checkpoint.run_dir")
    drain.add_argument("--engine", type=int, required=True, help="the engine to drain")
    drain.add_argument("--from-step", type=int, default=0, help="first step it no longer serves (default: next)")
    ls = verbs.add_parser("list", help="the requests and their outcomes")
    ls.add_argument("run_dir", help="the job's checkpoint.run_dir")
    p.set_defaults(run=run)


def _pool_engines(run_dir: str) -> int:
    """The engines the job starts with; refuses a run whose engines are not supervised."""
    from megatron_maspo.config import load_config
    from megatron_maspo.errors import ConfigError

    cfg = load_config(run_dir)  # MissingPathError (one line, exit 2) when it is not a run directory
    ro = cfg.rollout
    if not (ro.disaggregated and ro.supervise_engines):
        raise ConfigError(f"{run_dir}: engines join or leave only a job with rollout.placement=disaggregated "
                          "and rollout.supervise_engines=true")
    return ro.engine_ranks // ro.engine_tp


def run(args: argparse.Namespace) -> int:
    from megatron_maspo.errors import ConfigError
    from megatron_maspo.rollout.supervision import elastic

    engines = _pool_engines(args.run_dir)
    control = elastic.ControlDir(args.run_dir)
    requests = control.requests()
    fleet = elastic.fleet_of(requests, engines)
    if args.verb == "list":
        outcomes = control.outcomes()
        for r in requests:
            o = outcomes.get(r.seq)
            state = ("pending" if o is None else f"applied before step {o['step']}" if o["ok"]
                     else f"refused before step {o['step']}: {o['detail']}")
            print(f"{r.name}: {r.verb} engine {r.engine} (owner {r.owner}, from step {r.from_step}): {state}")
        print(f"pool after every request: {len(fleet)} engines {sorted(fleet)}")
        return 0
    if args.from_step < 0:
        raise ConfigError(f"--from-step must be >= 0, got {args.from_step}")
    if args.verb == "add":
        owner = elastic.default_owner(requests, engines) if args.owner is None else args.owner
        if not 0 <= owner < engines:
            raise ConfigError(f"--owner {owner}: the pool's owners are engines 0..{engines - 1}")
        try:
            gpus = tuple(int(g) for g in args.gpus.split(",")) if args.gpus else None
        except ValueError:
            raise ConfigError(f"--gpus {args.gpus!r}: expected comma-separated GPU indices") from None
        req = control.submit("add", engine=elastic.next_engine_id(requests, engines), owner=owner,
                             from_step=args.from_step, gpus=gpus)
    else:
        if args.engine not in fleet:
            raise ConfigError(f"engine {args.engine} is not in the pool (engines {sorted(fleet)})")
        owner = fleet[args.engine]
        if sum(o == owner for o in fleet.values()) == 1:
            raise ConfigError(f"engine {args.engine} is the last engine of owner {owner}: it cannot be drained")
        req = control.submit("drain", engine=args.engine, owner=owner, from_step=args.from_step)
    print(f"{control.requests_dir / req.name}: {req.verb} engine {req.engine} (owner {req.owner}); "
          f"applied at the owner's next batch boundary" + (f" from step {req.from_step}" if req.from_step else ""))
    return 0
