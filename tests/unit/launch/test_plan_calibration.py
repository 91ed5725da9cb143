"""The planner stays within 0.67x-1.5x of published RL step splits, phase by phase.

Runs and commands: megatron_maspo/launch/plan_calibration.py; table: docs/planner-calibration.md.
"""

from __future__ import annotations

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan_calibration import PHASES, RUNS, planned

BAND = (0.67, 1.5)

_NO_CP = ("context parallelism is not modelled (the config has no CP), and the measured 64 s train / 75 s "
          "log-prob for 1.8 M tokens on 128 GPUs imply 5-10% MFU, which FLOP counting at 0.35 cannot reach")
KNOWN_OFF = {("Llama-3.3-70B, 128 GPUs, CP4, 16k", "update"): _NO_CP,
             ("Llama-3.3-70B, 128 GPUs, CP4, 16k", "old_logprob"): _NO_CP}


def _cases():
    for run in RUNS:
        for phase in PHASES:
            why = KNOWN_OFF.get((run.name, phase))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(run, phase, id=f"{run.name.split(',')[0]}-{run.nodes * 8}gpu-{phase}", marks=marks)


_CACHE: dict[str, dict[str, float]] = {}


@pytest.mark.parametrize("run,phase", list(_cases()))
def test_phase_within_band_of_published_run(run, phase):
    got = _CACHE.setdefault(run.name, planned(run))
    ratio = got[phase] / run.measured[phase]
    assert BAND[0] <= ratio <= BAND[1], f"{run.name} {phase}: planner {got[phase]:.1f} s / measured " \
                                        f"{run.measured[phase]:.0f} s = {ratio:.2f}"


def test_cli_command_prints_the_same_figures(capsys):
    """The documented ``maspo plan`` command is the planner path the table uses."""
    run = RUNS[0]
    main(["plan", *run.argv()])
    out = capsys.readouterr().out
    got = planned(run)
    assert f"generation {got['generation']:.0f}  old-logprob {got['old_logprob']:.0f}" in out
    assert f"total {got['total']:.0f}" in out


def test_an_exponential_tail_would_miss_the_long_budget_run():
    """Why the tail defaults to the budget: a light-tailed guess under-estimates the 16k run ~3x."""
    run = next(r for r in RUNS if "16k" in r.name)
    light = planned(run, exponential_tail=True)["generation"] / run.measured["generation"]
    budget = _CACHE.setdefault(run.name, planned(run))["generation"] / run.measured["generation"]
    assert light < BAND[0] <= budget <= BAND[1]
