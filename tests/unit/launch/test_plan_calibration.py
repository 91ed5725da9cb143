"""The planner stays within 0.67x-1.5x of published RL step splits, phase by phase.

Runs and commands: megatron_maspo/launch/plan/calibration.py; table: docs/planner-calibration.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan.calibration import (
    HELD_OUT,
    LONG_BUDGET,
    LONG_BUDGET_RESPONSE_MEAN,
    LONG_HELD_OUT,
    MEASURED_CONTROLLER_GB_S,
    PHASES,
    RUNS,
    PublishedRun,
    planned,
    table,
)

BAND = (0.67, 1.5)

_CP_NOT_ENOUGH = ("the measured 64 s train / 75 s log-prob are 3.3x / 5.7x the FLOP time (CP ring included); "
                  "NeMo-RL v0.3.0's controller ships the 16k-padded batch to all 64 tp*pp*cp ranks per call "
                  "(launch/plan/dispatch.py), which closes both cells only at 1.2-2.9 GB/s of (de)serialisation, "
                  "above the 0.7-0.8 GB/s measured here; not fitted (docs/planner-calibration.md)")
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


def _long_cases():
    for run in LONG_HELD_OUT:
        for phase in run.measured:
            yield pytest.param(run, phase, id=f"{run.name.split(',')[0]}-{run.name.split(', ')[-1]}-{phase}")


@pytest.mark.parametrize("run,phase", list(_long_cases()))
def test_long_budget_small_model_phase_within_band(run, phase):
    """1.5B and 7B runs at 28k budgets with published mean responses (RLinf's comparison page), planned
    with the constants of the other tables: no constant or input was chosen with these figures."""
    got = _CACHE.setdefault(run.name, planned(run))
    ratio = got[phase] / run.measured[phase]
    assert BAND[0] <= ratio <= BAND[1], f"{run.name} {phase}: planner {got[phase]:.1f} s / measured " \
                                        f"{run.measured[phase]:.0f} s = {ratio:.2f}"


def test_long_held_out_rows_bring_their_own_published_lengths():
    """Each held-out long-budget row is planned at the mean response its source publishes (not the
    verl rows' fitted mean), with the source's 27,648-token budget as the tail."""
    assert {r.response_mean for r in LONG_HELD_OUT} == {14254.84, 13975.0, 10425.77}
    for run in LONG_HELD_OUT:
        assert "held out" in run.name and run.response_max is None
        assert "rollout.max_new_tokens=27648" in run.sets
        assert {"total", "generation", "update"} <= set(run.measured)


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
    come out, not held to the band) exactly as ``python -m megatron_maspo.launch.plan.calibration``
    prints them: a planner change that moves any figure must update the docs."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "planner-calibration.md").read_text()
    assert table() in doc
    assert table(runs=HELD_OUT) in doc
    assert table(runs=LONG_BUDGET) in doc  # the long-budget small-model rows
    assert table(runs=LONG_HELD_OUT) in doc  # long budgets with published response lengths
    assert table(controller_gb_s=MEASURED_CONTROLLER_GB_S) in doc  # the "Out of band" comparison


def test_the_cp_run_is_planned_with_context_parallelism():
    run = next(r for r in RUNS if "CP4" in r.name)
    assert "parallel.cp=4" in run.sets and "model.attention_backend=te" in run.sets
    assert "parallel.tp=4" in run.sets and "parallel.pp=4" in run.sets  # NeMo-RL v0.3.0's 70B layout


def _window(run: PublishedRun, phase: str) -> tuple[float, float]:
    """Controller rates (GB/s) that put ``phase`` of ``run`` inside the band; the dispatch term is
    bytes / rate, so the planned seconds are base + (seconds at 1 GB/s) / rate."""
    base = planned(run)[phase]
    per = planned(run, controller_gb_s=1.0)[phase] - base
    m = run.measured[phase]
    return per / (BAND[1] * m - base), per / (BAND[0] * m - base)


def test_controller_dispatch_closes_the_16k_cells_only_above_the_rate_measured_here():
    """NeMo-RL's single-controller data shipping (launch/plan/dispatch.py) is what separates the 16k run
    from its FLOP time, but at the (de)serialisation rate measured on our machine it over-shoots both
    cells; the rates that put both in band are 1.5x-3.5x that. The other rows stay in band either way, so
    the term is consistent with them; it is not turned on in ``RUNS`` (docs/planner-calibration.md)."""
    run = next(r for r in RUNS if "16k" in r.name)
    lo = max(_window(run, "update")[0], _window(run, "old_logprob")[0])
    hi = min(_window(run, "update")[1], _window(run, "old_logprob")[1])
    assert MEASURED_CONTROLLER_GB_S < lo < hi
    assert (round(lo, 1), round(hi, 1)) == (1.2, 2.9)
    at_measured = planned(run, controller_gb_s=MEASURED_CONTROLLER_GB_S)
    assert at_measured["update"] / 64 > BAND[1] and at_measured["old_logprob"] / 75 > BAND[1]
    for other in (r for r in RUNS if r is not run):
        got = planned(other, controller_gb_s=MEASURED_CONTROLLER_GB_S)
        for phase in PHASES:
            assert BAND[0] <= got[phase] / other.measured[phase] <= BAND[1], (other.name, phase)


def test_long_budget_rows_share_one_fitted_input_and_report_the_rest():
    """The verl 7B 28k rows: one recipe, one mean response (fitted on the 32-GPU row's update, the only
    value chosen with a measured figure in view), and the two held-out rows planned with it unchanged."""
    assert {r.response_mean for r in LONG_BUDGET} == {LONG_BUDGET_RESPONSE_MEAN}
    assert len({r.sets for r in LONG_BUDGET}) == 1 and [r.nodes for r in LONG_BUDGET] == [4, 8, 16]
    fitted = LONG_BUDGET[0]
    assert "fitted" in fitted.name and all("held out" in r.name for r in LONG_BUDGET[1:])
    got = planned(fitted)
    assert 0.95 <= got["update"] / fitted.measured["update"] <= 1.05
    for run in LONG_BUDGET:  # every published phase is planned; the ratios are reported, not banded
        assert set(run.measured) <= set(planned(run))


def test_a_published_layout_that_ran_with_offload_fits_with_offload(capsys):
    """verl's 7B 28k colocated run offloaded its trainer state: without the offload flags the plan is
    refused on its rollout peak, and the memory verdict names offload with its margin and cost."""
    run = LONG_BUDGET[0]
    argv = [a for a in run.argv()]
    for flag in ("train.offload_params=true", "train.offload_grads=true", "train.offload_optimizer=true"):
        i = argv.index(flag)
        del argv[i - 1:i + 1]
    assert main(["plan", *argv]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("memory verdict: fits with offload,"))
    assert "GiB" in line and "s per step" in line and "--set train.offload_params=true" in line
    assert main(["plan", *run.argv()]) == 0  # as published: fits
