"""Without a terminal, the warm start prints plain status lines on rank 0 (a pipe is not silent)."""

from __future__ import annotations

import io

from megatron_maspo.train.observe.progress import Progress


def test_plain_status_lines_when_not_a_terminal():
    out = io.StringIO()  # not a TTY: no bars
    p = Progress(total=3, enabled=True, stream=out)
    p.status_every_s = 0.0  # every item, for the test
    assert list(p.iterate(range(3), "SFT warm start", unit="step")) == [0, 1, 2]
    lines = out.getvalue().splitlines()
    assert lines[0] == "SFT warm start: 0/3 step ..."
    assert [ln.split(" (")[0] for ln in lines[1:]] == [f"SFT warm start: {k}/3 step" for k in (1, 2, 3)]


def test_other_ranks_stay_quiet():
    out = io.StringIO()
    p = Progress(total=3, enabled=False, stream=out)
    p.status_every_s = 0.0
    assert list(p.iterate(range(2), "SFT warm start")) == [0, 1] and out.getvalue() == ""
