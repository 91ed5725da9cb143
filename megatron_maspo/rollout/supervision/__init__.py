"""Rollout engines in failure domains of their own: each engine an OS process of its own, watched for
death and for silence, restarted within a budget, re-sent the current weights (digest-verified) before
it takes work, and its unfinished prompt groups re-issued to live engines (docs/engine-faults.md).

    ledger.py          which prompt chunks are pending, running (where, since when) and done (pure)
    health.py          engine slots, the silence rule, the restart budget, the failure line (pure)
    engine_process.py  the engine's own process: build, load + verify, generate, report progress
    supervisor.py      the parent side: processes, their links per restart epoch, the monitor loop
"""
