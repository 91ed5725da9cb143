"""The planner stays within 0.67x-1.5x of published RL step splits, phase by phase.

Runs and commands: megatron_maspo/launch/plan_calibration.py; table: docs/planner-calibration.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan_calibration import HELD_OUT, PHASES, RUNS, planned, table

BAND = (0.67, 1.5)

_CP_NOT_ENOUGH = ("CP4 is modelled (rows split over 4 ranks, exposed ring K/V exchange: +0.9 s log-prob, +1.7 s "
                  "update) and attention is 0.8% of the FLOPs at 900-token sequences; the measured 64 s train / "
                  "75 s log-prob for 1.8 M tokens on 128 GPUs are 2.6x / 6.0x the FLOP time at 0.35 MFU, a gap "
                  "no physical CP or long-sequence term closes (docs/planner-calibration.md)")
KNOWN_OFF = {("Llama-3.3-70B, 128 GPUs, CP4, 16k", "update"): _CP_NOT_ENOUGH,
             ("Llama-3.3-70B, 128 GPUs, CP4, 16k", "old_logprob"): _CP_NOT_ENOUGH}


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


def test_docs_tables_are_what_the_planner_prints_now():
    """docs/planner-calibration.md shows the calibrated table and the held-out runs (reported as they
    come out, not held to the band) exactly as ``python -m megatron_maspo.launch.plan_calibration``
    prints them: a planner change that moves any figure must update the docs."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "planner-calibration.md").read_text()
    assert table() in doc
    assert table(runs=HELD_OUT) in doc


def test_the_cp_run_is_planned_with_context_parallelism():
    run = next(r for r in RUNS if "CP4" in r.name)
    assert "parallel.cp=4" in run.sets and "model.attention_backend=te" in run.sets
