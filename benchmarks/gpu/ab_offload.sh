#!/usr/bin/env bash
# A/B of one GPU check training between this tree ("new") and an older mpar ("old"),
# alternating in one invocation (a borrowed GPU's figures drift from run to run).
#
# Here, once:   git archive <commit> mpar | tar -x -C .ab/old   (.ab/ ignored)
# On the GPU:   benchmarks/gpu/ab_offload.sh [zero] [rounds]     (carry .ab)
# zero: a training of benchmarks/gpu/check.py (ZERO; default "offload"); rounds: 2.
set -euo pipefail
cd "$(dirname "$0")/../.."
zero=${1:-offload}
rounds=${2:-2}
python=${PYTHON:-$(command -v python3 || command -v python)}
for round in $(seq "$rounds"); do
  for v in new old; do
    if [ "$v" = old ]; then path=.ab/old; else path=.; fi
    PYTHONPATH=$path timeout 90 "$python" benchmarks/gpu/check.py --part train --size 1b \
      --device cuda --steps 5 --zero "$zero" --out "/tmp/ab_$v" 2>&1 | grep '^RESULT' |
      "$python" -c "
import json, statistics, sys
r = json.loads(sys.stdin.read()[len('RESULT '):])
print('$v round $round: step', round(statistics.median(r['step_seconds']), 3), 's (median),',
      'step MFU', round(r['step_mfu'], 4), 'back to back', round(r['steady_mfu'], 4),
      'ledger', r['syncs']['ledger'], flush=True)"
  done
done
