"""Published Qwen3.5 sizes as ``ArchSpec`` fields (text model of each checkpoint's ``config.json``)."""

from __future__ import annotations

from typing import Any

DENSE_PRESETS: dict[str, dict[str, Any]] = {}
MOE_PRESETS: dict[str, dict[str, Any]] = {}
