#!/usr/bin/env bash
# Every --algo preset on the bundled default (same model, task, seed and step count), then one plot.
#   bash experiments/presets.sh [STEPS] [JOBS]      # defaults: 100 steps, 2 runs at a time
# Writes runs/<algo>/ for each preset and docs/presets.png, and prints the table of docs/measurements.md.
# 100 steps: about 20 minutes on 2 CPU cores.
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
# The table of docs/measurements.md: held-out accuracy at the first and last evaluation, generated tokens, s/step.
$PY - $ALGOS <<'PY'
import json, sys

print("| `--algo` | greedy, step 0 -> last | mean@4, step 0 -> last | generated tokens | s/step | max GSS |")
print("|---|---|---|---|---|---|")
for algo in sys.argv[1:]:
    rows = [json.loads(line) for line in open(f"runs/{algo}/metrics.jsonl")]
    evals, steps = [r for r in rows if "eval/greedy_accuracy" in r], [r for r in rows if "loss" in r]
    first, last = evals[0], evals[-1]
    greedy, mean4 = (f"{first[k]:.1%} -> {last[k]:.1%}" for k in ("eval/greedy_accuracy", "eval/mean@4"))
    tokens = sum(r["tokens/generated"] for r in steps) / 1e6
    s_step = sum(r["time/step_s"] for r in steps) / len(steps)
    print(f"| `{algo}` | {greedy} | {mean4} | {tokens:.2f} M | {s_step:.2f} | {max(r['gss'] for r in steps):.1f} |")
PY
