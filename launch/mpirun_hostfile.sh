#!/usr/bin/env bash
# Training with mpirun/mpiexec across the hosts of a hostfile.
#
#   HOSTFILE=launch/hostfile.example NPROC_PER_NODE=4 launch/mpirun_hostfile.sh [script args]
#
# mpar.init() finds its rank through mpi4py (pip install "mpar[mpi]"); node 0
# picks the rendezvous port and tells the others. Passwordless ssh between the
# hosts is needed, as for any MPI job. Equivalent: mpar launch --mpi --hostfile.
set -euo pipefail

HOSTFILE="${HOSTFILE:-launch/hostfile.example}"
NPROC_PER_NODE="${NPROC_PER_NODE:-4}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-examples/train_cnn.py}"
PYTHON="${PYTHON:-python}"
MPIEXEC="${MPIEXEC:-mpiexec}"
# Optional: export MPAR_CONFIG=/path/to/config.json before running this script.

NNODES=$(grep -cvE '^[[:space:]]*(#|$)' "$HOSTFILE")
NPROCS=$(( NNODES * NPROC_PER_NODE ))
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / NPROC_PER_NODE ))
    (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
    export OMP_NUM_THREADS
fi

if "$MPIEXEC" --version 2>&1 | grep -q "Open MPI"; then
    # Open MPI: place by count per node; export our variables to remote hosts.
    EXPORTS=(-x PATH -x OMP_NUM_THREADS)
    [[ -z "${MPAR_CONFIG:-}" ]] || EXPORTS+=(-x MPAR_CONFIG)
    exec "$MPIEXEC" -n "$NPROCS" --hostfile "$HOSTFILE" --map-by "ppr:${NPROC_PER_NODE}:node" \
        "${EXPORTS[@]}" "$PYTHON" "$TRAIN_SCRIPT" "$@"
else
    # MPICH / Intel MPI (Hydra): the whole environment is passed by default.
    exec "$MPIEXEC" -n "$NPROCS" -f "$HOSTFILE" -ppn "$NPROC_PER_NODE" \
        "$PYTHON" "$TRAIN_SCRIPT" "$@"
fi
