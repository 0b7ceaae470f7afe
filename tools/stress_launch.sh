#!/usr/bin/env bash
# Repeats the test suite's multi-process launches (tests/scripts/replay_multiprocess.py under DDP, DeepSpeed ZeRO-2
# and ZeRO-3, single- and multi-turn, and resumes from a checkpoint) N times in all, and prints
# "launches: N, failures: F" (and per kind). A launch fails when it exits non-zero, runs past its time limit, or a rank
# prints an abort ("terminate called", "Fatal Python error") even with exit status 0.
#
#   tools/stress_launch.sh N [OUT_DIR] [KIND ...]
#
# KIND is any of: ddp zero2 zero3 ddp-multi-turn zero2-multi-turn zero3-multi-turn zero2-resume zero3-resume
# ddp-tools zero3-tools (TRL's tool loop with replay, tests/scripts/tool_replay_multiprocess.py) ddp-guided
# (experience-guided rollouts; zero3 guides too, as tests/distributed/test_multiprocess.py launches them) ddp-exgrpo
# zero3-exgrpo (replay_profile="exgrpo": start by capability, retired questions; a whole run, then its resume)
# ddp-teach zero3-teach (rescue and retired questions with revisits, saving the model after training; the same)
# ddp-defaults zero3-defaults (the library's defaults: rescue and the spread plan; the same)
# (default: these, in turn; a resume first runs the whole run it resumes from, and both count as launches), or
# exit-race, exit-race-destroy, exit-race-plain: tests/scripts/gloo_exit.py's "natural" exit race (DDP, 3 s a launch)
# ended by exit_distributed(), by barrier + destroy_process_group(), or not at all; name them to compare the endings
# in one run, e.g. `tools/stress_launch.sh 60 out exit-race-plain exit-race-destroy exit-race`.
# Each failure keeps its folder OUT_DIR/<i>-<kind>/: the launch's full log, every core file a rank dumped, and
# `gdb -batch -ex "thread apply all bt"` of each core (core-*.bt.txt). Passing launches leave nothing behind.
# Cores: the script raises `ulimit -c` and runs each launch in its own folder, where a relative kernel.core_pattern
# (the default "core") puts them; with a piped pattern (systemd-coredump, apport) it says so and cores go there.
# Environment: PYTHON (default python3), LAUNCH_TIMEOUT (seconds a launch may run, default 480).
set -uo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]] || usage
N=$1
OUT=${2:-stress-launch-$(date +%Y%m%d-%H%M%S)}
shift $(( $# >= 2 ? 2 : 1 ))
SUITE_KINDS=(ddp zero2 zero3 ddp-multi-turn zero2-multi-turn zero3-multi-turn zero2-resume zero3-resume ddp-tools
  zero3-tools ddp-guided ddp-exgrpo zero3-exgrpo ddp-teach zero3-teach ddp-defaults zero3-defaults)
ALL_KINDS=("${SUITE_KINDS[@]}" exit-race exit-race-destroy exit-race-plain)
KINDS=("${@:-${SUITE_KINDS[@]}}")
for kind in "${KINDS[@]}"; do
  [[ " ${ALL_KINDS[*]} " == *" $kind "* ]] || { echo "unknown kind '$kind'; allowed: ${ALL_KINDS[*]}" >&2; exit 2; }
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$(command -v "${PYTHON:-python3}")
LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-480}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SCRIPT="$REPO/tests/scripts/replay_multiprocess.py"
EXIT_RACE="$REPO/tests/scripts/gloo_exit.py"
TOOLS_SCRIPT="$REPO/tests/scripts/tool_replay_multiprocess.py"

ulimit -c unlimited 2>/dev/null || echo "warning: could not raise the core size limit; failures will have no core" >&2
pattern=$(cat /proc/sys/kernel/core_pattern 2>/dev/null || echo unknown)
if [[ "$pattern" == "|"* ]]; then
  echo "note: kernel.core_pattern pipes cores to ${pattern#|}; they will not be in the failure folders" >&2
elif ! command -v gdb >/dev/null; then
  echo "note: gdb not found (apt-get install gdb); cores are kept without backtraces" >&2
fi

# The accelerate configs name their DeepSpeed json relative to the repository; each launch runs in a folder of its
# own (so cores land there), so it gets copies that name it absolutely.
CONFIGS="$OUT/configs"
mkdir -p "$CONFIGS"
for name in ddp_cpu zero2_cpu zero3_cpu; do
  sed "s#deepspeed_config_file: recipes/#deepspeed_config_file: $REPO/recipes/#" \
    "$REPO/recipes/accelerate/$name.yaml" >"$CONFIGS/$name.yaml"
done

export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu PYTHONFAULTHANDLER=1
# DeepSpeed JIT-builds an op under a lock file; a private build folder cannot inherit a stale lock (tests/launching.py)
export TORCH_EXTENSIONS_DIR="$OUT/torch_extensions"

descendants() { local child; for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done; }

# launch DIR CONFIG SCRIPT [SCRIPT_ARGS...]: one bounded `accelerate launch` in DIR; returns its status (124 past the
# limit).
launch() {
  local dir=$1 config=$2 script=$3 pid status
  shift 3
  mkdir -p "$dir"
  (cd "$dir" && exec "$PYTHON" -m accelerate.commands.launch --config_file "$CONFIGS/$config.yaml" "$script" "$@") \
    >"$dir/launch.log" 2>&1 &
  pid=$!
  local deadline=$((SECONDS + LAUNCH_TIMEOUT))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then  # a hang: every rank prints its Python stack (SIGABRT), then all are ended
    local ranks
    ranks=$(descendants "$pid")
    echo "=== no exit within ${LAUNCH_TIMEOUT}s: SIGABRT to ranks $ranks ===" >>"$dir/launch.log"
    for rank in $ranks; do kill -ABRT "$rank" 2>/dev/null; sleep 2; done
    sleep 5
    kill -KILL $ranks "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 124
  fi
  wait "$pid"
  status=$?
  if ((status == 0)) && grep -qE "terminate called|Fatal Python error" "$dir/launch.log"; then
    status=134  # a rank aborted but the launcher still reported success
  fi
  return "$status"
}

keep_evidence() {  # backtraces of every core in the failure's folder
  local dir=$1 core
  for core in $(find "$dir" -maxdepth 2 -name 'core*' -type f ! -name '*.bt.txt'); do
    if command -v gdb >/dev/null; then
      gdb -batch -nx -ex "info threads" -ex "thread apply all bt" "$PYTHON" "$core" >"$core.bt.txt" 2>&1
    fi
  done
}

launches=0 failures=0
declare -A kind_launches kind_failures
started=$SECONDS
echo "stress_launch: $N launches of: ${KINDS[*]}; out: $OUT; core_pattern: $pattern; python: $PYTHON"
i=0
while ((launches < N)); do
  kind=${KINDS[i % ${#KINDS[@]}]}
  i=$((i + 1))
  config=${kind%%-*}_cpu
  dir="$OUT/$i-$kind"
  before=$launches
  case "$kind" in
    exit-race*)
      ending=${kind#exit-race}
      ending=${ending#-}
      if launch "$dir" ddp_cpu "$EXIT_RACE" natural "${ending:-exit_distributed}"; then status=0; else status=$?; fi
      launches=$((launches + 1))
      ;;
    *-resume)
      if launch "$dir/whole" "$config" "$SCRIPT" "$dir/whole/out"; then status=0; else status=$?; fi
      launches=$((launches + 1))
      if ((status == 0 && launches < N)); then
        if launch "$dir/resumed" "$config" "$SCRIPT" "$dir/resumed/out" "resume=$dir/whole/out/run/checkpoint-3"; then
          status=0
        else
          status=$?
        fi
        launches=$((launches + 1))
      fi
      ;;
    *-exgrpo | *-teach | *-defaults)
      profile=${kind#*-}
      if launch "$dir/whole" "$config" "$SCRIPT" "$dir/whole/out" "$profile"; then status=0; else status=$?; fi
      launches=$((launches + 1))
      if ((status == 0 && launches < N)); then
        checkpoint="$dir/whole/out/run/checkpoint-6"
        if launch "$dir/resumed" "$config" "$SCRIPT" "$dir/resumed/out" "$profile" "resume=$checkpoint"; then
          status=0
        else
          status=$?
        fi
        launches=$((launches + 1))
      fi
      ;;
    *-tools)
      if launch "$dir" "$config" "$TOOLS_SCRIPT" "$dir/out"; then status=0; else status=$?; fi
      launches=$((launches + 1))
      ;;
    *-multi-turn)
      if launch "$dir" "$config" "$SCRIPT" "$dir/out" multi-turn; then status=0; else status=$?; fi
      launches=$((launches + 1))
      ;;
    *-guided)
      if launch "$dir" "$config" "$SCRIPT" "$dir/out" guided; then status=0; else status=$?; fi
      launches=$((launches + 1))
      ;;
    *)
      extra=()
      [[ $kind == zero3 ]] && extra=(trl-options guided)  # as tests/distributed/test_multiprocess.py launches it
      if launch "$dir" "$config" "$SCRIPT" "$dir/out" "${extra[@]}"; then status=0; else status=$?; fi
      launches=$((launches + 1))
      ;;
  esac
  kind_launches[$kind]=$((${kind_launches[$kind]:-0} + launches - before))
  kind_failures[$kind]=$((${kind_failures[$kind]:-0} + (status != 0)))
  if ((status == 0)); then
    rm -rf "$dir"
    verdict=ok
  else
    failures=$((failures + 1))
    keep_evidence "$dir"
    verdict="FAILED (status $status): $dir"
  fi
  printf '[%4ds] %3d/%d %-18s %s\n' $((SECONDS - started)) "$launches" "$N" "$kind" "$verdict"
done
rm -rf "$CONFIGS" "$TORCH_EXTENSIONS_DIR"
for kind in "${KINDS[@]}"; do
  [[ -n "${kind_launches[$kind]:-}" ]] && echo "  $kind: launches ${kind_launches[$kind]}, failures ${kind_failures[$kind]}"
done
echo "launches: $launches, failures: $failures"
((failures == 0))
