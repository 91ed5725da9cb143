"""Where per-step metrics go: JSONL (always), TensorBoard (default), W&B (when configured).

Only rank 0 writes; other ranks get a :class:`NullSink`, so call sites need no ``if rank == 0``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class NullSink:
    """Discards everything (non-zero ranks)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _clean(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class JsonlSink:
    """One JSON object per step in ``metrics.jsonl``; truncates records past ``resume_step`` on resume.

    ``step`` counts from 1 (the record of step k is the state after k updates, as ``checkpoints/step_k``).
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            # A resumed run continues after its checkpoint (step_<resume_step>): drop records of the
            # steps it will redo.
            kept = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", -1) <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        self._f = path.open("a", buffering=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        rec = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(rec, sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """TensorBoard scalars under ``<run_dir>/tb``."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            f = _clean(v)
            if f is not None:
                self._w.add_scalar(k, f, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """Weights & Biases; imported lazily, only when a project is configured."""

    def __init__(self, project: str, run_dir: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logging.wandb_project is set but wandb is missing: "
                              "pip install 'megatron-maspo[wandb]'") from e
        self._run = wandb.init(project=project, dir=str(run_dir), config=config, resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log({k: v for k, v in metrics.items() if _clean(v) is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiSink:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for s in self.sinks:
            s.log(metrics, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def build_sink(run_dir: Path, *, rank: int, tensorboard: bool, wandb_project: str | None,
               config: dict, resume_step: int | None = None) -> MetricsSink:
    """The sinks for this rank: JSONL + optional TensorBoard/W&B on rank 0, nothing elsewhere."""
    if rank != 0:
        return NullSink()
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        except ImportError:
            logger.warning("tensorboard is not installed; TensorBoard logging is off "
                           "(pip install 'megatron-maspo[logging]')")
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_dir, config))
    return MultiSink(sinks)


def read_metrics(path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file."""
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
