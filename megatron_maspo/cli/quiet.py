"""Keep third-party start-up noise off the console unless ``maspo --verbose``.

Without Transformer Engine and Apex (every CPU run, and GPU runs that skip them) Megatron-Core warns
once per importing module that it falls back to torch implementations (~15 lines before step 1),
its DDP logs the parameter list of every gradient bucket, its optimizer and DDP dump their whole
config at INFO, and each checkpoint load repeats two torch deprecation FutureWarnings. None of that
needs action from the user. Only these sources are filtered: any other
warning, and every WARNING-or-worse log record (Megatron's included), still reaches the console.

Spawned processes (conversion ranks, grader workers) inherit the warning filters through
``PYTHONWARNINGS``; they do not configure logging, so Megatron's INFO records never print there.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # (category, start of the message): Megatron-Core import-time fallbacks when TE / Apex are absent.
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    # TransformerConfig's own default cuda_graph_scope="full" warns on every construction; the value
    # is only read when CUDA graphs are enabled, which no recipe does.
    (UserWarning, "full scope is deprecated"),
    # torch deprecations that Megatron's dist-checkpoint loader triggers on every load (resume, eval,
    # conversion); nothing a user of this package can change.
    (FutureWarning, "`load_state_dict` is deprecated"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""Warnings ignored by message prefix (exact, case-sensitive start of the message)."""

FUTURE_WARNING_MODULES = (r"transformers(\..*)?",)
"""Modules whose ``FutureWarning`` deprecation notices are ignored (they repeat per call site)."""

FUTURE_WARNING_TEXT = (r".*past_key_values",)
"""``FutureWarning`` messages ignored wherever they are raised: transformers' ``past_key_values`` notice
is attributed to torch's frame (the module filter above misses it) and split the progress bar at step 1.
The cause is fixed in ``rollout/hf_cache.py`` (the cache goes under the name ``forward`` declares; 5.24's
rename logs through transformers' logger, which no warning filter reaches); this stays for model classes
of other releases that warn on their own."""

QUIET_LOGGERS = ("megatron.core", "matplotlib")
"""Loggers set to WARNING: config dumps, per-bucket parameter lists, FSDP/TE detection notes, and
matplotlib's font-cache notes when the plots are drawn at the end of a run."""


def configure_console(verbose: bool) -> None:
    """Install the filters above (nothing when ``verbose``); call before anything imports megatron."""
    if verbose:
        return
    specs = []
    for category, prefix in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=category)
        specs.append(f"ignore:{prefix}:{category.__name__}")
    for module in FUTURE_WARNING_MODULES:
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    for pattern in FUTURE_WARNING_TEXT:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Child processes: PYTHONWARNINGS entries are "action:message-prefix:category" (no ':' or ','
    # inside a field, which the prefixes above respect).
    entries = [x for x in os.environ.get("PYTHONWARNINGS", "").split(",") if x]
    os.environ["PYTHONWARNINGS"] = ",".join(entries + [s for s in specs if s not in entries])
