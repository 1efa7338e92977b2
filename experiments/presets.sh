#!/usr/bin/env bash
# Every --algo preset on the bundled default (same model, task, seed and step count), then one plot.
#   bash experiments/presets.sh [STEPS] [JOBS]      # defaults: 100 steps, 2 runs at a time
# Writes runs/<algo>/ for each preset and docs/presets.png. 100 steps: about 20 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-100}
JOBS=${2:-2}
PY=${PY:-$( [ -n "${VIRTUAL_ENV:-}" ] && echo python || echo .venv/bin/python )}
ALGOS="grpo_ma grpo dr_grpo dapo gspo two_grpo agrae gtpo dagrpo cispo"
# One thread per run when several run at once: more threads than cores makes each run several times slower.
THREADS=$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))
printf '%s\n' $ALGOS | OMP_NUM_THREADS=$THREADS xargs -P "$JOBS" -I{} sh -c "$PY train.py --algo {} --max-steps $STEPS --out runs/{} > runs/{}.log 2>&1 && echo done {}"
$PY eval.py --plot $(for a in $ALGOS; do echo runs/$a; done) --out docs/presets.png
