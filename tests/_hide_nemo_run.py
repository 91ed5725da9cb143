"""pytest plugin (``-p tests._hide_nemo_run``): behave as if the ``launch`` extra were not installed.

``sys.modules[name] = None`` makes ``importlib.util.find_spec`` return None and ``import nemo_run`` raise
ImportError, exactly what a machine without nemo-run shows.
"""

import sys

sys.modules["nemo_run"] = None  # type: ignore[assignment]
