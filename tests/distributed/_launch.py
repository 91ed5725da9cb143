"""Test-side alias of the package's spawn helper (see megatron_maspo/parallel/launch.py)."""

from megatron_maspo.parallel.launch import WorkerError, free_port, run_workers

__all__ = ["WorkerError", "free_port", "run_workers"]
