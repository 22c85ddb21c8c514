#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu/check.py: what it runs, its limits):
#   benchmarks/gpu/check.sh            # on the GPU machine; results: $OUT/check.json
#   benchmarks/gpu/check.sh --cpu      # the reduced CPU mode that CI runs
# PYTHON picks the interpreter (default: python3, else python).
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-$(command -v python3 || command -v python)}
exec "$python" benchmarks/gpu/check.py "$@"
