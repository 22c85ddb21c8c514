#!/usr/bin/env bash
# Multi-node training with plain torchrun (no mpar launcher needed).
#
# Run this same script once on every node, changing only NODE_RANK:
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/torchrun_multinode.sh
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/torchrun_multinode.sh
# Extra arguments are passed to the training script:
#   ... launch/torchrun_multinode.sh --steps 100
#
# torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT for every process; mpar.init() reads them. The mpar config goes
# through MPAR_CONFIG. `mpar launch` takes the same --nnodes/--node-rank/
# --master-addr/--master-port options and also sets OMP_NUM_THREADS sensibly.
set -euo pipefail

NNODES="${NNODES:-2}"                      # number of machines
NPROC_PER_NODE="${NPROC_PER_NODE:-4}"      # processes per machine (e.g. one per GPU)
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0..NNODES-1 on each node}"
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, reachable from every node}"
MASTER_PORT="${MASTER_PORT:-29500}"        # a free TCP port on node 0
TRAIN_SCRIPT="${TRAIN_SCRIPT:-examples/train_gpt.py}"
# Optional: export MPAR_CONFIG=/path/to/config.json (the environment reaches every process).

# Share the CPUs of a node between its processes (torchrun alone would set 1).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / NPROC_PER_NODE ))
    (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
    export OMP_NUM_THREADS
fi

exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" \
    "$TRAIN_SCRIPT" "$@"
