"""The planner as a package: its entry points stay importable from ``megatron_maspo.launch.plan``, it
imports nothing from ``train/``, and what it shares with the trainer is one object, re-exported there."""

from __future__ import annotations

import subprocess
import sys

import megatron_maspo.launch.plan as plan
from megatron_maspo.launch.plan import disagg, estimator, types
from megatron_maspo.parallel import layout_check, offload_categories


def test_entry_points_stay_importable_from_the_package():
    from megatron_maspo.launch.plan import (  # noqa: F401  (the import is the test)
        Assumptions,
        arch_of,
        estimate,
        estimate_disaggregated,
        layout_of,
    )

    assert plan.estimate is estimator.estimate and plan.arch_of is estimator.arch_of
    assert plan.layout_of is estimator.layout_of and plan.Assumptions is types.Assumptions
    assert plan.estimate_disaggregated is disagg.estimate_disaggregated
    assert all(hasattr(plan, name) for name in plan.__all__)


def test_importing_the_planner_imports_no_trainer_and_no_script():
    """``dispatch`` and ``calibration`` run as ``python -m`` scripts: the package must not import them first."""
    code = ("import sys, megatron_maspo.launch.plan; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_maspo.train') "
            "or m in ('megatron_maspo.launch.plan.dispatch', 'megatron_maspo.launch.plan.calibration')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_trainer_re_exports_what_moved_below_it():
    from megatron_maspo.train.actor import offload
    from megatron_maspo.train.preflight import check_layout_supported

    assert offload.CATEGORIES is offload_categories.CATEGORIES
    assert offload.offload_categories is offload_categories.offload_categories
    assert check_layout_supported is layout_check.check_layout_supported
