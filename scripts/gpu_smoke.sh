#!/usr/bin/env bash
# One-GPU smoke test of the cluster path, sized for the lent machine's window: the part timeouts add up
# to 480 s (`--list`), so a run and a rerun of its failed parts fit 15 minutes of device time with the
# machine's start.
#
# Parts (each fails loudly, is killed at its own timeout, and the next part runs anyway):
#   install      wheels from scripts/wheels/ into a private site dir (megatron-core, math-verify, ...)
#   nccl         a 1-rank NCCL group: a CUDA all-reduce works, a CPU tensor is refused loudly
#   train        `maspo train --recipe tiny` in bf16 after a 60-step SFT warm start (so rewards differ
#                within groups), built-in engine on CUDA, training state offloaded during generation;
#                checks metrics.jsonl: finite loss and non-zero grad norm every step, memory/* per phase
#   convert_h2m  `maspo convert hf-to-megatron --verify` of a tiny Qwen2 on CUDA (error <= tolerance)
#   convert_m2h  `maspo convert megatron-to-hf --verify` of that checkpoint back to HF (error <= tolerance)
#   logprobs     vocab-parallel log-probs + entropy vs a naive full log-softmax: error, time, memory
#   lp_bf16      the same kernels on bf16 inputs vs float64 of the same inputs (tolerance)
#   ipc          buckets of a real model through rollout/transport.py (CUDA IPC; shared memory on CPU)
#                into a spawned built-in engine process: bitwise check of every parameter, GB/s
#   sleep        engine sleep/wake + trainer offload/reload (train/actor/offload.py): bit-exact, memory per phase
#   mismatch     trainer (Megatron) vs engine (transformers) log-probs of the same sampled tokens (tolerance)
#   varlen       model.attention_backend='varlen' (one varlen flash call per layer) vs packed_sdpa logits
#                (skipped with --cpu: the kernel is CUDA only). Kernel alone: python scripts/gpu_smoke.py varlen
#   disagg       `maspo train` with rollout.placement=disaggregated, two torchrun agents (one process each) on the one
#                GPU (CUDA_VISIBLE_DEVICES=0 for both: a one-rank training pool, a one-rank rollout pool
#                with the built-in engine, weights bridge staged on the host), 2 steps at k = 1; checks
#                metrics.jsonl: finite loss, gradient norm and reward, bytes synced every step
# and prints one summary table (PASS/FAIL per part, with its figures). Exit status: failed parts.
#
# Usage:
#   bash scripts/gpu_smoke.sh                 # on the GPU machine: every part
#   bash scripts/gpu_smoke.sh --only ipc,sleep  # a subset (names from --list)
#   bash scripts/gpu_smoke.sh --list          # NAME SECONDS per part (SECONDS = its enforced timeout)
#   bash scripts/gpu_smoke.sh --bench         # install, then the benchmarks instead of the smoke:
#                                             #   bench_kernels    scripts/bench_logprob_kernels.py (vs Liger, CCE)
#                                             #   bench_transport  scripts/bench_weight_transport.py (vs a D2D copy)
#                                             # (--bench --list: their limits; --only may name them too)
#   bash scripts/gpu_smoke.sh --cpu           # rehearsal: the same entry points on CPU (gloo, fp32 where
#                                             # the GPU run uses bf16, small shapes); timeouts x10
#   bash scripts/gpu_smoke.sh --dry-run       # print what would run
#   bash scripts/gpu_smoke.sh --fetch-wheels  # on a machine WITH network: fill scripts/wheels/
#
# Wheels (scripts/wheels/ is git-ignored). The target has Python 3.12, torch 2.11 (with its own
# requirements: setuptools, sympy, networkx, jinja2, fsspec, filelock), triton, transformers (with
# huggingface_hub, tokenizers, regex, packaging), numpy, safetensors, pyyaml, tqdm and psutil already
# (TARGET_HAS below). Everything else this project and the carried wheels require is carried (CARRIED):
#   megatron-core 0.16.1   requires torch, numpy, packaging>=24.2 (the image's packaging is whatever
#                          transformers accepted, >=20: carried so megatron-core gets what it declares)
#   math-verify 0.9.0      requires latex2sympy2_extended==1.11.0
#   latex2sympy2_extended  requires sympy, antlr4-python3-runtime>=4.9.3,<=4.13.2
#   antlr4-python3-runtime requires nothing on Python 3
# tests/unit/scripts/test_gpu_smoke.py re-reads those requirements from the installed metadata.
# --fetch-wheels runs exactly:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d scripts/wheels \
#       megatron-core==0.16.1          # has a compiled helper: the cp312 manylinux wheel exists on PyPI
#   pip download --no-deps --only-binary=:all: -d scripts/wheels \
#       math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
#       packaging==26.4                # pure Python
#   pip wheel --no-deps --no-build-isolation -w scripts/wheels .     # this project (py3-none-any)
# If no megatron_maspo wheel is there, the checkout itself is put on PYTHONPATH; with --cpu the checkout
# always comes first (the rehearsal tests this checkout), and wheels this Python cannot install (the
# cp312 megatron-core on another Python) are skipped and named: the local environment stands in.
# Through this workplace's device tool: run(command="bash scripts/gpu_smoke.sh", carry=["scripts/wheels"]).
# The next megatron-core (docs/stack.md): fetch its wheel into a second folder and point the run at it,
#   SMOKE_MCORE=0.19.2 SMOKE_WHEELS=scripts/wheels-next bash scripts/gpu_smoke.sh --fetch-wheels
#   SMOKE_WHEELS=scripts/wheels-next bash scripts/gpu_smoke.sh --only nccl,train,convert_h2m
# (0.19 imports triton, which the target has; its Python 3.12 is what 0.19 requires).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${SMOKE_WHEELS:-$REPO/scripts/wheels}"   # SMOKE_WHEELS: another folder (the tests use one)
PY="${PYTHON:-python3}"
MODE=gpu
DRY=0
BENCH=0
LIST=0
ONLY=""
# Part timeouts in seconds on the GPU (the --cpu rehearsal multiplies them by SMOKE_TIMEOUT_SCALE).
# Keep the sum <= 480 (tests/unit/scripts/test_gpu_smoke.py): with the machine's start, one run fits 15
# minutes of device time with room for a rerun of the parts that failed. Set from the first H200 run
# (2026-12-04): train's 60 SFT + 3 RL steps took 42 s of launch-bound tiny kernels, and each part's cold
# start (CUDA context, imports) took 15-30 s there, against 13 s for all of train on the 2-core CPU box;
# nccl, logprobs and lp_bf16 took 6, 10 and 5 s.
PARTS=(install:30 nccl:10 train:90 convert_h2m:60 convert_m2h:45 logprobs:20 lp_bf16:15 ipc:35 sleep:30
       mismatch:40 varlen:30 disagg:75)
# The benchmarks, run only with --bench or when --only names them: 270 s with install, a second command
# on the same warm machine (the smoke's 480 s, these 270 s and the machine's start fit 15 minutes once).
BENCH_PARTS=(bench_kernels:150 bench_transport:90)
BENCH_WHEELS=(liger-kernel==0.8.5 cut-cross-entropy==25.1.1)   # the kernel peers, pure Python (triton)
TARGET_HAS=(torch triton transformers sympy numpy safetensors pyyaml tqdm psutil)
CARRIED=(megatron-core==${SMOKE_MCORE:-0.16.1} math-verify==0.9.0 latex2sympy2_extended==1.11.0
         antlr4-python3-runtime==4.13.2 packaging==26.4)
while [ $# -gt 0 ]; do
  arg="$1"; shift
  case "$arg" in
    --cpu) MODE=cpu ;;
    --bench) BENCH=1 ;;
    --dry-run) DRY=1 ;;
    --list) LIST=1 ;;
    --only) [ $# -gt 0 ] || { echo "--only needs NAME[,NAME] (see --list)" >&2; exit 2; }
            ONLY="$1"; shift ;;
    --only=*) ONLY="${arg#--only=}" ;;
    --fetch-wheels)
      set -e
      mkdir -p "$WHEELS"
      "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$WHEELS" "${CARRIED[0]}"
      "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" "${CARRIED[@]:1}" "${BENCH_WHEELS[@]}"
      "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "$REPO"
      ls -l "$WHEELS"
      exit 0 ;;
    -h|--help) sed -n '2,/^set -uo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

declare -A LIMIT
for p in "${PARTS[@]}" "${BENCH_PARTS[@]}"; do LIMIT[${p%%:*}]=${p##*:}; done
if [ "$LIST" = 1 ]; then
  total=0
  LISTED=("${PARTS[@]}"); [ "$BENCH" = 1 ] && LISTED=(install:30 "${BENCH_PARTS[@]}")
  for p in "${LISTED[@]}"; do echo "${p%%:*} ${p##*:}"; total=$((total + ${p##*:})); done
  echo "total $total"
  exit 0
fi
if [ -n "$ONLY" ]; then
  IFS=, read -ra WANT <<<"$ONLY"
  for w in "${WANT[@]}"; do
    [ -n "${LIMIT[$w]:-}" ] || { echo "--only: unknown part '$w'; parts: ${!LIMIT[*]}" >&2; exit 2; }
  done
fi
# selected NAME: is the part in --only (or is there no --only)? install also runs whenever there are
# wheels to install: the other parts import megatron-core and math-verify from them.
selected() {
  local b is_bench=0
  for b in "${BENCH_PARTS[@]}"; do [ "${b%%:*}" = "$1" ] && is_bench=1; done
  if [ -z "$ONLY" ]; then  # no --only: the smoke's parts, or install and the benchmarks with --bench
    [ "$1" = install ] && return 0
    [ "$is_bench" = "$BENCH" ]; return
  fi
  [ "$1" = install ] && ls "$WHEELS"/*.whl >/dev/null 2>&1 && return 0
  local w; for w in "${WANT[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1
}

if [ "$DRY" = 1 ]; then
  WORK="${SMOKE_DIR:-${TMPDIR:-/tmp}/maspo_smoke.DRYRUN}"
else
  WORK="${SMOKE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/maspo_smoke.XXXXXX")}"
  mkdir -p "$WORK"
fi
SITE="$WORK/site"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       PYTHONUNBUFFERED=1
if [ "$MODE" = cpu ]; then
  export CUDA_VISIBLE_DEVICES=""   # the rehearsal must not touch a GPU even where one exists
  export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the checkout; the GPU target is thrown away, so
                                    # there each module compiled once serves every later part
  CPU_FLAG=--cpu; BF16=false; STEPS=2; DISAGG_GPUS=""
  TIMEOUT_SCALE="${SMOKE_TIMEOUT_SCALE:-10}"  # shared 2-core boxes: conversion alone took 150 s there
else
  CPU_FLAG=; BF16=true; STEPS=3; DISAGG_GPUS=0   # disagg: both ranks on GPU 0
  TIMEOUT_SCALE="${SMOKE_TIMEOUT_SCALE:-1}"   # the part limits add up to 6 minutes
fi

NAMES=(); STATUS=(); SECS=(); FIGS=()

# run_part NAME CMD...: run with the part's timeout, log to $WORK/NAME.log, keep its SMOKE line.
run_part() {
  local name="$1" limit=$((${LIMIT[$1]} * TIMEOUT_SCALE)); shift 1
  selected "$name" || return 0
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
  fig="$(grep -h '^SMOKE ' "$WORK/$name.log" | tail -n 1 | cut -c7-180)"   # one line per part: one screen
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

# install_wheels: the wheels this Python can install go into $SITE. On the GPU target every one must
# (a skipped one fails the part); in the --cpu rehearsal a cp312 wheel on another Python is skipped and
# named, and this environment's own install stands in. Then the modules are imported, not just found:
# a missing dependency of a carried wheel (antlr4 under math-verify) fails here, not mid-run.
install_wheels() {
  local line wheels=() skipped=()
  while read -r line; do
    case "$line" in "use "*) wheels+=("${line#use }") ;; "skip "*) skipped+=("${line#skip }") ;; esac
  done < <("$PY" - "$WHEELS" <<'PY'
import glob, sys
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
ok = set(sys_tags())
for w in sorted(glob.glob(sys.argv[1] + "/*.whl")):
    name, version, _, tags = parse_wheel_filename(w.rsplit("/", 1)[1])
    print(f"use {w}" if tags & ok else f"skip {name}-{version}")
PY
)
  if [ "${#wheels[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" || return 1
    # Byte-compile once, on every core: with --no-compile and no writable cache every later process
    # would compile megatron-core's modules again at import (the first H200 run lost its part limits so).
    "$PY" -m compileall -q -j 0 "$SITE" >/dev/null || return 1
  fi
  echo "installed into $SITE"
  echo "SMOKE install: ${#wheels[@]} wheels;" \
       "${skipped[*]:+skipped (not for this Python): ${skipped[*]};} project from $PROJECT_FROM"
  if [ "${#skipped[@]}" -gt 0 ] && [ "$MODE" = gpu ]; then echo "the target must install every wheel" >&2; return 1; fi
  "$PY" - <<'PY'
import sys
import torch
import megatron.core.parallel_state  # noqa: F401
import math_verify
import transformers  # noqa: F401
import megatron_maspo
ok = math_verify.verify(math_verify.parse("$\\frac{1}{2}$"), math_verify.parse("0.5"))
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}, "
      f"megatron_maspo from {megatron_maspo.__file__}, math-verify 1/2 == 0.5: {ok}")
sys.exit(0 if ok else "math-verify does not grade 1/2 == 0.5")
PY
}

PYPATH="$SITE"; PROJECT_FROM=wheel
if [ "$MODE" = cpu ]; then
  PYPATH="$REPO:$SITE"; PROJECT_FROM=checkout   # the rehearsal tests this checkout, wheel or not
elif ! ls "$WHEELS"/megatron_maspo-*.whl >/dev/null 2>&1; then
  PYPATH="$SITE:$REPO"; PROJECT_FROM=checkout
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
SMOKE="$REPO/scripts/gpu_smoke.py"

export PY WHEELS SITE MODE PROJECT_FROM
export -f install_wheels
PARTS_PY="$REPO/scripts/gpu_smoke_parts.py"
run_part install bash -c install_wheels
run_part nccl "$PY" "$SMOKE" nccl $CPU_FLAG
# 60 SFT steps: the tiny model then solves some sums, so rewards differ inside groups and every RL step
# has non-zero advantages (with 2 SFT steps every reward was -1: zero advantages, zero gradients).
run_part train bash -c "\"$PY\" -m megatron_maspo.cli.main train --recipe tiny \
  --set model.bf16=$BF16 --set train.steps=$STEPS --set train.sft_steps=60 --set train.prompts_per_step=8 \
  --set train.mini_batches_per_step=2 --set rollout.group_size=4 --set checkpoint.save_every=0 \
  --set checkpoint.run_dir=$WORK/train --set logging.tensorboard=false --set logging.plots=false \
  --set logging.progress=false --set reward.num_workers=1 --set train.offload_params=true \
  --set train.offload_grads=true --set train.offload_optimizer=true \
  && \"$PY\" \"$SMOKE\" check-train $WORK/train --steps $STEPS $CPU_FLAG"
# Conversion tolerances: fp32 folders, so the logits must agree to float rounding (the --cpu run and
# the GPU run both convert fp32; TF32 is off in torch by default for matmuls).
run_part convert_h2m bash -c "\"$PY\" \"$SMOKE\" make-hf $WORK/hf && \"$PY\" -m megatron_maspo.cli.main \
  convert hf-to-megatron --hf $WORK/hf --out $WORK/mcore --verify 2>&1 | tee $WORK/h2m.out \
  && \"$PY\" \"$SMOKE\" check-verify $WORK/h2m.out --tol 1e-4"
run_part convert_m2h bash -c "\"$PY\" -m megatron_maspo.cli.main convert megatron-to-hf --ckpt $WORK/mcore \
  --out $WORK/hf_back --verify 2>&1 | tee $WORK/m2h.out && \"$PY\" \"$SMOKE\" check-verify $WORK/m2h.out --tol 1e-4"
run_part logprobs "$PY" "$SMOKE" logprobs $CPU_FLAG
run_part bench_kernels "$PY" "$REPO/scripts/bench_logprob_kernels.py" $CPU_FLAG
run_part bench_transport "$PY" "$REPO/scripts/bench_weight_transport.py" $CPU_FLAG
run_part lp_bf16 "$PY" "$PARTS_PY" lp_bf16 $CPU_FLAG
run_part ipc "$PY" "$PARTS_PY" ipc $CPU_FLAG
run_part sleep "$PY" "$PARTS_PY" sleep $CPU_FLAG
run_part mismatch "$PY" "$PARTS_PY" mismatch $CPU_FLAG
run_part varlen "$PY" "$PARTS_PY" varlen $CPU_FLAG
# disagg: rollout.placement=disaggregated on the one GPU: a one-rank training pool and a one-rank rollout
# pool (built-in engine), two processes, both on GPU 0. Launched as two torchrun agents (--nnodes 2, one
# process each) on this host, so each is LOCAL_RANK 0 of a one-GPU "node" (one torchrun with two processes
# would give the second LOCAL_RANK 1, which has no GPU and is refused). The weights bridge's two members
# then share a GPU, which the bridge detects (comm.gpu_identity): NCCL refuses that, so it is gloo with host
# buckets. It exercises the weight receiver loop and the wait for the first sync on real CUDA streams
# (issue 43, A and C); not the pools' backends or a GPU-to-GPU sync (B, D), which need two GPUs. k = 1, so
# generation overlaps training.
DISAGG_PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
DISAGG_TRAIN="-m megatron_maspo.cli.main train --recipe tiny --set rollout.placement=disaggregated \
  --set rollout.engine_ranks=1 --set rollout.max_staleness=1 --set loss.tis_cap=2.0 --set model.bf16=$BF16 \
  --set train.steps=2 --set train.sft_steps=40 --set model.tiny_num_layers=1 --set model.tiny_hidden_size=64 \
  --set train.prompts_per_step=4 --set rollout.group_size=4 --set rollout.max_new_tokens=8 \
  --set train.overlong_buffer=4 --set data.num_examples=32 --set train.max_tokens_per_micro_batch=256 \
  --set reward.num_workers=1 --set checkpoint.save_every=0 --set checkpoint.run_dir=$WORK/disagg \
  --set logging.tensorboard=false --set logging.plots=false --set logging.progress=false"
DISAGG_AGENT="CUDA_VISIBLE_DEVICES=$DISAGG_GPUS \"$PY\" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$DISAGG_PORT"
run_part disagg bash -c "$DISAGG_AGENT --node-rank 1 $DISAGG_TRAIN > $WORK/disagg_agent1.log 2>&1 & a1=\$!; \
  $DISAGG_AGENT --node-rank 0 $DISAGG_TRAIN; rc=\$?; wait \$a1; rc1=\$?; cat $WORK/disagg_agent1.log; \
  [ \$rc = 0 ] && [ \$rc1 = 0 ] && \"$PY\" \"$SMOKE\" check-train $WORK/disagg --steps 2 --pools $CPU_FLAG"

echo
echo "gpu_smoke summary ($MODE mode; logs in $WORK)"
printf '%-16s %-5s %6s  %s\n' part result secs figures
[ "${#NAMES[@]}" -gt 0 ] || echo "(no part selected)"
failed=0
for i in "${!NAMES[@]}"; do
  printf '%-16s %-5s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${FIGS[$i]}"
  [ "${STATUS[$i]}" = FAIL ] && failed=$((failed + 1))
done
exit "$failed"
