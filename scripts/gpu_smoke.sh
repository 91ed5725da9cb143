#!/usr/bin/env bash
# One-GPU smoke test of the cluster path (at most ~8 minutes on one H200, no network needed).
#
# Parts (each fails loudly, is timed out on its own, and the next part runs anyway):
#   install      wheels from scripts/wheels/ into a private site dir (megatron-core, math-verify, ...)
#   nccl         a 1-rank NCCL group: a CUDA all-reduce works, a CPU tensor is refused loudly
#   train        `maspo train --recipe tiny` for 3 steps in bf16, built-in engine on CUDA, training
#                state offloaded during generation; checks metrics.jsonl (finite loss, memory/* per phase)
#   convert_h2m  `maspo convert hf-to-megatron --verify` of a tiny Qwen2 on CUDA
#   convert_m2h  `maspo convert megatron-to-hf --verify` of that checkpoint back to HF on CUDA
#   logprobs     vocab-parallel log-probs + entropy (logits given / from hidden) vs a naive full
#                log-softmax on CUDA: error, time and peak-memory ratios measured in the same run
#   varlen       attention_backend='varlen''s one-call varlen flash kernel vs per-sequence SDPA (bf16,
#                7B head shapes): error and time ratio (skipped in --cpu mode: no CPU kernel)
# and prints one summary table (PASS/FAIL per part, with its figures). Exit status: failed parts.
#
# Usage:
#   bash scripts/gpu_smoke.sh                 # on the GPU machine
#   bash scripts/gpu_smoke.sh --cpu           # rehearsal: the same entry points on CPU (gloo, fp32,
#                                             # small shapes); a few minutes on 2 cores
#   bash scripts/gpu_smoke.sh --dry-run       # print what would run
#   bash scripts/gpu_smoke.sh --fetch-wheels  # on a machine WITH network: fill scripts/wheels/
#
# Wheels (scripts/wheels/ is git-ignored; the target has Python 3.12, torch 2.11, triton, transformers,
# sympy, numpy, safetensors, pyyaml, tqdm and psutil already). --fetch-wheels runs exactly:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d scripts/wheels \
#       megatron-core==0.16.1          # has a compiled helper: the cp312 manylinux wheel exists on PyPI
#   pip download --no-deps --only-binary=:all: -d scripts/wheels \
#       math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2  # pure Python
#   pip wheel --no-deps --no-build-isolation -w scripts/wheels .     # this project (py3-none-any)
# If no megatron_maspo wheel is there, the checkout itself is put on PYTHONPATH.
# Through this workplace's device tool: run(command="bash scripts/gpu_smoke.sh", carry=["scripts/wheels"]).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$REPO/scripts/wheels"
PY="${PYTHON:-python3}"
MODE=gpu
DRY=0
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --dry-run) DRY=1 ;;
    --fetch-wheels)
      set -e
      mkdir -p "$WHEELS"
      "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$WHEELS" megatron-core==0.16.1
      "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" \
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
      "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "$REPO"
      ls -l "$WHEELS"
      exit 0 ;;
    -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

if [ "$DRY" = 1 ]; then
  WORK="${SMOKE_DIR:-${TMPDIR:-/tmp}/maspo_smoke.DRYRUN}"
else
  WORK="${SMOKE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/maspo_smoke.XXXXXX")}"
  mkdir -p "$WORK"
fi
SITE="$WORK/site"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ "$MODE" = cpu ]; then
  export CUDA_VISIBLE_DEVICES=""   # the rehearsal must not touch a GPU even where one exists
  CPU_FLAG=--cpu; BF16=false; STEPS=2
  TIMEOUT_SCALE="${SMOKE_TIMEOUT_SCALE:-5}"   # shared 2-core boxes are slow to import and spawn
else
  CPU_FLAG=; BF16=true; STEPS=3
  TIMEOUT_SCALE="${SMOKE_TIMEOUT_SCALE:-1}"   # the part limits add up to 8 minutes
fi

NAMES=(); STATUS=(); SECS=(); FIGS=()

# run_part NAME TIMEOUT_S CMD...: run with a timeout, log to $WORK/NAME.log, keep the SMOKE line.
run_part() {
  local name="$1" limit=$(($2 * TIMEOUT_SCALE)); shift 2
  NAMES+=("$name")
  if [ "$DRY" = 1 ]; then
    echo "[$name] (timeout ${limit}s) $*"; STATUS+=("DRY"); SECS+=(0); FIGS+=(""); return 0
  fi
  echo "=== [$name] $*"
  local t0=$SECONDS rc
  ( cd "$WORK" && timeout --kill-after=10 "$limit" "$@" ) >"$WORK/$name.log" 2>&1
  rc=$?
  SECS+=($((SECONDS - t0)))
  local fig
  fig="$(grep -h '^SMOKE \|^verify: \|^wrote ' "$WORK/$name.log" | tail -n 2 | tr '\n' ' ')"
  if [ "$rc" = 0 ]; then
    STATUS+=("PASS")
  else
    STATUS+=("FAIL")
    [ "$rc" = 124 ] && fig="TIMEOUT after ${limit}s. $fig"
    echo "--- [$name] FAILED (exit $rc); last lines of $WORK/$name.log:" >&2
    tail -n 25 "$WORK/$name.log" >&2
  fi
  FIGS+=("$fig")
  return 0
}

install_wheels() {
  local whl=("$WHEELS"/*.whl)
  if [ -e "${whl[0]}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${whl[@]}" || return 1
  fi
  echo "SMOKE install: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels into $SITE; project from" \
       "$(ls "$WHEELS"/megatron_maspo-*.whl >/dev/null 2>&1 && echo wheel || echo checkout)"
  "$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("torch", "megatron.core", "math_verify", "transformers", "megatron_maspo")
           if importlib.util.find_spec(m) is None]
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
sys.exit(f"missing modules: {missing}") if missing else None
EOF
}

PYPATH="$SITE"
ls "$WHEELS"/megatron_maspo-*.whl >/dev/null 2>&1 || PYPATH="$SITE:$REPO"
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
SMOKE="$REPO/scripts/gpu_smoke.py"

export PY WHEELS SITE
export -f install_wheels
run_part install 60 bash -c install_wheels
run_part nccl 45 "$PY" "$SMOKE" nccl $CPU_FLAG
run_part train 180 bash -c "\"$PY\" -m megatron_maspo.cli.main train --recipe tiny \
  --set model.bf16=$BF16 --set train.steps=$STEPS --set train.sft_steps=2 --set train.prompts_per_step=8 \
  --set train.mini_batches_per_step=2 --set rollout.group_size=4 --set checkpoint.save_every=0 \
  --set checkpoint.run_dir=$WORK/train --set logging.tensorboard=false --set logging.plots=false \
  --set logging.progress=false --set reward.num_workers=1 --set train.offload_params=true \
  --set train.offload_grads=true --set train.offload_optimizer=true \
  && \"$PY\" \"$SMOKE\" check-train $WORK/train --steps $STEPS $CPU_FLAG"
run_part convert_h2m 75 bash -c "\"$PY\" \"$SMOKE\" make-hf $WORK/hf && \"$PY\" -m megatron_maspo.cli.main \
  convert hf-to-megatron --hf $WORK/hf --out $WORK/mcore --verify"
run_part convert_m2h 60 "$PY" -m megatron_maspo.cli.main convert megatron-to-hf --ckpt "$WORK/mcore" \
  --out "$WORK/hf_back" --verify
run_part logprobs 60 "$PY" "$SMOKE" logprobs $CPU_FLAG
run_part varlen 30 "$PY" "$SMOKE" varlen $CPU_FLAG

echo
echo "gpu_smoke summary ($MODE mode; logs in $WORK)"
printf '%-12s %-5s %6s  %s\n' part result secs figures
failed=0
for i in "${!NAMES[@]}"; do
  printf '%-12s %-5s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${FIGS[$i]}"
  [ "${STATUS[$i]}" = FAIL ] && failed=$((failed + 1))
done
exit "$failed"
