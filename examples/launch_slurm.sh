#!/usr/bin/env bash
# Submit a recipe to a Slurm cluster (pyxis/enroot containers, InfiniBand) through NeMo-Run (needs the
# `launch` extra). Edit the variables or set them in the environment; JOB_DIR must be on a filesystem
# every node sees (the resolved config and the checkpoints go there).
#
#   ACCOUNT=my-acct PARTITION=batch bash examples/launch_slurm.sh --dry-run   # print the sbatch script
#   ACCOUNT=my-acct PARTITION=batch bash examples/launch_slurm.sh             # submit
#
# Check the layout first: `maspo plan $RECIPE --nodes $NODES --gpus-per-node $GPUS`.
# Extra arguments go to `maspo launch` (--set section.field=value, --env KEY=VALUE, --dry-run, ...).
set -euo pipefail
RECIPE=${RECIPE:-r1_distill_qwen_7b_maspo}
NODES=${NODES:-4}
GPUS=${GPUS:-8}
ACCOUNT=${ACCOUNT:?set ACCOUNT to your Slurm account}
PARTITION=${PARTITION:?set PARTITION to a GPU partition}
TIME=${TIME:-04:00:00}
IMAGE=${IMAGE:-nvcr.io/nvidia/pytorch:25.09-py3}
MODELS=${MODELS:-/lustre/models}   # mounted at /models (recipes read the HF weights from there)
DATA=${DATA:-/lustre/data}         # mounted at /data
JOB_DIR=${JOB_DIR:-/lustre/$USER/maspo}
exec maspo launch "$RECIPE" --executor slurm --nodes "$NODES" --gpus-per-node "$GPUS" \
    --account "$ACCOUNT" --partition "$PARTITION" --time "$TIME" --container-image "$IMAGE" \
    --mount "$MODELS:/models" --mount "$DATA:/data" --job-dir "$JOB_DIR" "$@"
