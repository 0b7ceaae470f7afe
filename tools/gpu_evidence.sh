#!/usr/bin/env bash
# Replay against GRPO with a from-scratch model larger than the CPU allows, on one GPU: the `replay` stage of
# tools/gpu_check.sh (../shared/GPU.md, check 2). One process per (method, seed), all at once on the one card.
# Its limits (TUNE_LIMIT + REPORT_LIMIT, 550 s) fit the replay stage's 570 s and, with the install, the device's
# 600 s a call.
#
#   1. tuning: GRPO alone on TUNE_SEEDS at each of LEARNING_RATES; the rate with the highest mean final held-out
#      success of GRPO is kept (ties: the first listed). The baseline's rate, chosen on seeds that are not reported.
#   2. report: METHODS on REPORT_SEEDS at that rate; `replay_vs_grpo.py --report` prints the tables.
#      TUNE_SEEDS="" with one rate in LEARNING_RATES skips the tuning; REPORT_FROM=results.json starts the report from
#      runs made before (a method and seed run again replaces its run).
#
# Measured on an H200 (docs/gpu.md): with 15 runs at once, 400 steps of the 512 x 8 model took GRPO 0.46 s a step
# (185 s), exgrpo 0.60 s; the 5 exreplay runs did not end within 300 s. Run fewer at once (METHODS=exreplay), and
# know that a run stopped at its limit records nothing.
#
# Everything lands in $OUT/evidence.tgz (tuning/ and report/, each a results.json with its plots; packed after each
# phase, so a stage stopped during the report keeps the tuning) and $OUT/evidence.log (every run's output, the rule's
# choice, the report's tables).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
TESTBED=${TESTBED:-single-turn}
MODEL=${MODEL:-"--model hidden_size=512 --model num_layers=8 --model num_heads=8"}
LEARNING_RATES=${LEARNING_RATES:-"3e-4 1e-4 3e-5"}
TUNE_SEEDS=${TUNE_SEEDS-"60 61"}  # may be empty
REPORT_SEEDS=${REPORT_SEEDS:-"600 601 602 603 604"}
METHODS=${METHODS:-"grpo exreplay exgrpo"}
EXTRA=${EXTRA:-}  # more harness options for every run, e.g. "--max-steps 4 --set use_cpu=true" for a dry run on a CPU
TUNE_LIMIT=${TUNE_LIMIT:-170}
REPORT_LIMIT=${REPORT_LIMIT:-380}
WORK=/tmp/evidence
LOG="$OUT/evidence.log"
rm -rf "$WORK" && mkdir -p "$WORK/tuning" "$WORK/report" "$OUT"
: >"$LOG"
if [ -n "${REPORT_FROM:-}" ] && ! cp "$REPORT_FROM" "$WORK/report/results.json"; then
    echo "REPORT_FROM=$REPORT_FROM: no such results.json" | tee -a "$LOG"; exit 2
fi
# Each run has its own `timeout` (its own process group): when this script is stopped, stop them too.
trap 'kill $(jobs -p) 2>/dev/null; exit 143' TERM INT
pack() { tar czf "$OUT/evidence.tgz" -C "$WORK" tuning report; }

harness() {  # harness LIMIT_S LOG_NAME OUT_DIR ARGS...: one run of the harness on the GPU, in the background
    local limit=$1 name=$2 out=$3; shift 3
    # shellcheck disable=SC2086  # MODEL is meant to be split
    timeout --kill-after=5 "$limit" python3 benchmarks/replay_vs_grpo.py --testbed "$TESTBED" --out "$out" \
        --set use_cpu=false $MODEL --no-trl-check --no-progress $EXTRA "$@" >"$WORK/$name.log" 2>&1 &
}

echo "== tuning: grpo on seeds $TUNE_SEEDS at learning rates $LEARNING_RATES ($(date -u +%T))" | tee -a "$LOG"
for rate in $LEARNING_RATES; do
    for seed in $TUNE_SEEDS; do
        harness "$TUNE_LIMIT" "tune-lr$rate-$seed" "$WORK/tuning/lr$rate" --methods grpo --seeds "$seed" \
            --set learning_rate="$rate"
    done
done
wait
RATE=$(python3 - "$WORK/tuning" $LEARNING_RATES <<'EOF' 2>>"$LOG"
import json, sys
from pathlib import Path
finals = {}
for rate in sys.argv[2:]:
    path = Path(sys.argv[1]) / f"lr{rate}" / "results.json"
    runs = next(iter(json.loads(path.read_text())["testbeds"].values()))["methods"]["grpo"]["runs"] if path.exists() else {}
    finals[rate] = [run["points"][-1]["heldout_success"] for run in runs.values()]
    print(f"  lr {rate}: grpo final held-out {finals[rate]}", file=sys.stderr)
done = {rate: sum(v) / len(v) for rate, v in finals.items() if v}
print(max(done, key=done.get) if done else sys.argv[2])
EOF
)
pack
if [ -z "$RATE" ]; then echo "no learning rate chosen: see the log" | tee -a "$LOG"; exit 1; fi
echo "   chosen learning rate: $RATE ($(date -u +%T))" | tee -a "$LOG"

echo "== report: $METHODS on seeds $REPORT_SEEDS" | tee -a "$LOG"
for method in $METHODS; do
    for seed in $REPORT_SEEDS; do
        harness "$REPORT_LIMIT" "report-$method-$seed" "$WORK/report" --methods "$method" --seeds "$seed" \
            --set learning_rate="$RATE"
    done
done
wait
echo "== done ($(date -u +%T))" | tee -a "$LOG"
python3 benchmarks/replay_vs_grpo.py --report --out "$WORK/report" >>"$LOG" 2>&1
tail -n 3 "$WORK"/*.log >>"$LOG" 2>/dev/null
pack
tail -n 25 "$LOG"
