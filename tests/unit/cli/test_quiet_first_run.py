"""A default run's console: transformers' past_key_values FutureWarning and matplotlib's font notes are off."""

from __future__ import annotations

import logging
import warnings

from megatron_maspo.cli.quiet import configure_console


def test_past_key_values_future_warning_and_matplotlib_logs_are_filtered(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "")
    mpl = logging.getLogger("matplotlib.font_manager")
    before = logging.getLogger("matplotlib").level
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            configure_console(verbose=False)
            # raised from a torch frame in real runs, so a module= filter does not match it
            warnings.warn_explicit("`past_key_values` as a tuple of tuples is deprecated", FutureWarning,
                                   filename="torch/nn/modules/module.py", lineno=1, module="torch.nn.modules.module")
            warnings.warn("another FutureWarning stays visible", FutureWarning, stacklevel=2)
        assert [str(w.message) for w in seen] == ["another FutureWarning stays visible"]
        assert not mpl.isEnabledFor(logging.INFO)
    finally:
        logging.getLogger("matplotlib").setLevel(before)
