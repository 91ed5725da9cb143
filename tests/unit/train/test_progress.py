"""Console progress: bars only on a terminal (a real pseudo-terminal here), plain step lines elsewhere."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import select
import struct
import termios

import pytest

from megatron_maspo.train.observe.console import StepPrinter
from megatron_maspo.train.observe.progress import Progress


def _openpty(cols: int = 120) -> tuple[int, int]:
    """A pseudo-terminal with a real width (a fresh pty is 0 columns wide: tqdm would draw nothing)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    return master, slave


def _drain(fd: int) -> str:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def _run_steps(progress: Progress, steps: int) -> list[list[int]]:
    seen = []
    with progress:
        with progress.phase("SFT warm start", 2, "step") as advance:
            advance(2)
        progress.begin_steps()
        for k in range(1, steps + 1):
            calls: list[int] = []
            with progress.phase("generate", 8, "seq") as advance:
                for _ in range(4):
                    advance(2)
                    calls.append(2)
            logging.getLogger("maspo.test").warning("a log record while the bars are up")
            progress.step_done(f"step {k}/{steps} | reward +0.100")
            seen.append(calls)
    return seen


def test_not_a_terminal_prints_plain_lines_only(capsys):
    stream = io.StringIO()
    _run_steps(Progress(total=2, stream=stream), 2)
    assert stream.getvalue() == ""  # no bar drawn anywhere
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 1/2 | reward +0.100", "step 2/2 | reward +0.100"]


def test_disabled_draws_nothing_even_on_a_terminal(capsys):
    master, slave = _openpty()
    with os.fdopen(slave, "w") as tty:
        _run_steps(Progress(total=2, stream=tty, enabled=False), 2)
        tty.flush()
        assert _drain(master) == ""
    os.close(master)
    assert capsys.readouterr().out.count("step ") == 2


def test_terminal_gets_step_bar_with_eta_and_phase_bars(capsys):
    master, slave = _openpty()
    handler = logging.StreamHandler()  # a console handler, as logging.basicConfig installs
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with os.fdopen(slave, "w") as tty:
            _run_steps(Progress(total=3, initial=1, stream=tty), 2)
            tty.flush()
            drawn = _drain(master)
    finally:
        root.removeHandler(handler)
        os.close(master)
    assert "RL steps: 3/3" in drawn and "<" in drawn  # resumed at 1, two more steps; elapsed<remaining
    assert "generate:" in drawn and "0/8" in drawn and "SFT warm start" in drawn
    out = capsys.readouterr().out
    assert "step 1/2 | reward +0.100" in out and "step 2/2" in out  # summaries still on stdout


@pytest.mark.parametrize("rank,enabled,expected", [(0, True, "step    3/60 | reward +0.250 | acc 0.50"),
                                                   (1, True, None), (0, False, None)])
def test_step_line_counts_from_one(rank, enabled, expected):
    line = StepPrinter(rank, 60, enabled=enabled).format(3, {"reward/mean": 0.25, "reward/accuracy": 0.5})
    assert line == expected
