#!/usr/bin/env bash
# Run a recipe on this machine under torchrun, through NeMo-Run's local executor (needs the `launch`
# extra: pip install "megatron-maspo[launch]"). One process per GPU; without a GPU, CPU ranks over gloo.
#
#   bash examples/launch_local.sh                                  # tiny recipe, 2 CPU ranks, 60 steps
#   RECIPE=r1_distill_qwen_1p5b_maspo GPUS=8 bash examples/launch_local.sh
#   bash examples/launch_local.sh --set train.steps=1 --dry-run    # print the job, run nothing
#
# Extra arguments go to `maspo launch` (--set section.field=value, --dry-run, --name, ...).
set -euo pipefail
RECIPE=${RECIPE:-tiny}
GPUS=${GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
[ "${GPUS:-0}" -gt 0 ] || GPUS=2   # no GPU: two gloo ranks on the CPU
JOB_DIR=${JOB_DIR:-runs/launch}
# One OpenMP thread per rank: ranks share the cores, more threads only oversubscribe them.
exec maspo launch "$RECIPE" --executor local --gpus-per-node "$GPUS" --job-dir "$JOB_DIR" \
    --env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$@"
