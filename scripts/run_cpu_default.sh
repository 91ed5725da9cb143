#!/usr/bin/env bash
# Fresh-machine main job: venv + install (CPU constraints), then `maspo train` on the CPU default (the tiny
# recipe: a short supervised warm start, then MASPO RL with the built-in engine and math-verify rewards).
# Extra arguments go to `maspo train`, e.g. --set train.seed=2
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh logging
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec maspo train "$@"
