#!/usr/bin/env bash
# Fresh-machine main job: install the package (CPU constraints) and run `maspo train` on the CPU default
# (the tiny recipe: a short supervised warm start, then MASPO RL with the built-in engine and math-verify).
# Usage: bash scripts/run_cpu_default.sh [maspo train args, e.g. --set train.seed=2]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints/cpu.txt -e ".[logging]"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec maspo train "$@"
