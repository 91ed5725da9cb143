"""The record of a submitted Slurm job and its state, for ``maspo launch --status / --logs``.

``maspo launch --executor slurm`` writes ``<job_dir>/<name>/slurm_job.json`` (job id, log folder, run
directory) after sbatch accepted the job. The state comes from ``scontrol show job`` (slurmctld keeps a
finished job for MinJobAge seconds) and, when the cluster runs accounting, ``sacct``; no NeMo-Run here.
A requeued job keeps its id and writes one task log per attempt: ``log-*_<id>_<restart>.out``.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

RECORD = "slurm_job.json"


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    log_dir: str
    """Folder of the batch log (``sbatch_*_<id>.out``) and the task logs (``log-*_<id>_<restart>.out``)."""
    run_dir: str

    @property
    def log(self) -> str:
        """Glob of the task logs of every attempt (what --logs prints)."""
        return str(Path(self.log_dir) / f"log-*_{self.job_id}_*.out")

    def log_files(self) -> list[Path]:
        """Batch log, then the task logs in attempt order."""
        d = Path(self.log_dir)
        tasks = sorted(d.glob(f"log-*_{self.job_id}_*.out"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        return [*sorted(d.glob(f"sbatch_*_{self.job_id}.out")), *tasks]

    def read_log(self) -> str:
        parts = [f"==> {p} <==\n{p.read_text(errors='replace')}" for p in self.log_files()]
        return "\n".join(parts) if parts else f"(no log yet under {self.log_dir})\n"


def write_record(root: Path, record: JobRecord) -> Path:
    path = Path(root) / RECORD
    path.write_text(json.dumps(asdict(record), indent=1) + "\n")
    return path


def read_record(root: Path) -> JobRecord:
    from megatron_maspo.errors import MissingPathError

    path = Path(root) / RECORD
    if not path.is_file():
        raise MissingPathError(f"{path}: no Slurm job was submitted under this --job-dir/--name")
    return JobRecord(**json.loads(path.read_text()))


@dataclass(frozen=True)
class JobState:
    state: str
    """Slurm job state (PENDING, RUNNING, COMPLETED, FAILED, ...), or UNKNOWN once slurmctld forgot it."""
    exit_code: str = ""
    restarts: int = 0
    reason: str = ""

    def describe(self) -> str:
        out = self.state
        if self.exit_code and self.state not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED"):
            out += f", exit code {self.exit_code}"
        if self.restarts:
            out += f", requeued {self.restarts}x"
        if self.reason and self.reason != "None":
            out += f" ({self.reason})"
        return out


def parse_scontrol(text: str) -> JobState:
    """``scontrol show job -o ID`` (one line of Key=Value) -> JobState."""
    fields = dict(re.findall(r"(\w+)=(\S*)", text))
    return JobState(state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
                     restarts=int(fields.get("Restarts", "0") or 0), reason=fields.get("Reason", ""))


def job_state(job_id: str) -> JobState:
    """The job's state from slurmctld; UNKNOWN (with the reason) when it no longer knows the job."""
    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0 or "JobState=" not in r.stdout:
        return JobState(state="UNKNOWN", reason=(r.stderr.strip() or "not in slurmctld")[:200])
    return parse_scontrol(r.stdout)
