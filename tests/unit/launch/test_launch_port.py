"""``maspo launch`` (local executor) with a master port already in use: one line before anything starts,
instead of torchrun's EADDRINUSE traceback (a real listening socket and a real CLI process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def test_a_master_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "launch", "--executor", "local",
                            "--cpu", "--master-port", str(port), "--job-dir", str(tmp_path / "jobs"),
                            "--set", f"checkpoint.run_dir={tmp_path / 'run'}"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"maspo launch: error: --master-port {port} is in use on this host (another job's rendezvous?); "
        "pass a free one, e.g. --master-port 29501"], r.stderr
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "run").exists()
