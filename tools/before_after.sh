#!/usr/bin/env bash
# A refactor's figures, before and after, in one run: for each of two commits (clean worktrees), the package's
# non-blank lines per part with its `# fmt: skip` and over-long lines, the evidence harness's and the tests' lines,
# the calls trainer.py makes per generation batch (tools/generation_walk.py), then the fast lane's time and the whole
# suite's, the commits alternating so that both see the same machine.
#
#   OMP_NUM_THREADS=1 tools/before_after.sh BEFORE AFTER [--no-suite]
#
# Prints everything to stdout; leaves nothing behind (the worktrees are removed at the end).
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
BEFORE=$1 AFTER=$2 SUITE=${3:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'for t in "$WORK"/*/; do git -C "$REPO" worktree remove --force "$t" 2>/dev/null || true; done; rm -rf "$WORK"' EXIT
export TOKENIZERS_PARALLELISM=false
trees=()
for rev in "$BEFORE" "$AFTER"; do
  git -C "$REPO" worktree add -q --detach "$WORK/$rev" "$rev"
  trees+=("$WORK/$rev")
done

for tree in "${trees[@]}"; do
  echo "== $(basename "$tree") ($(git -C "$tree" rev-parse --short HEAD))"
  python3 - "$tree" <<'EOF'
import pathlib, sys
root = pathlib.Path(sys.argv[1])
PARTS = {  # the package's parts: file or folder names under trl_exreplay/
    "TRL glue": ["trainer.py", "replay.py", "step.py", "trl_seam.py", "compat.py", "distributed.py", "metrics.py",
                 "parameters.py", "parts.py", "custom_rollouts.py"],
    "algorithm": ["loss.py", "planner.py", "spread.py", "outcomes.py", "schedule.py", "selection.py", "config.py"],
    "pool/ and keeper": ["pool/", "keeper.py"],
    "envs/": ["envs/"], "guidance/": ["guidance/"], "alfworld/ and recipes/": ["alfworld/", "recipes/"],
}
def lines(path):
    return [line for line in path.read_text().splitlines() if line.strip()]
counts, skips, long = dict.fromkeys([*PARTS, "other"], 0), 0, 0
for path in sorted((root / "trl_exreplay").rglob("*.py")):
    rel = path.relative_to(root / "trl_exreplay").as_posix()
    part = next((p for p, names in PARTS.items() for n in names if rel == n or (n.endswith("/") and rel.startswith(n))),
                "other")
    counts[part] += len(lines(path))
    text = path.read_text().splitlines()
    skips += sum("# fmt: skip" in line for line in text)
    long += sum(len(line) > 120 for line in text)
for part, n in counts.items():
    print(f"  {part}: {n}")
print(f"  package: {sum(counts.values())}; `# fmt: skip`: {skips}; lines over 120 columns: {long}")
harness = [root / "benchmarks" / "replay_vs_grpo.py", *(root / "benchmarks" / "replay_harness").glob("*.py")]
sizes = [len(lines(p)) for p in harness if p.exists()]
print(f"  evidence harness: {sum(sizes)} in {len(sizes)} files (largest {max(sizes)})")
print(f"  tests: {sum(len(lines(p)) for p in (root / 'tests').rglob('*.py'))}")
EOF
  (cd "$tree" && PYTHONPATH="$tree" python3 tools/generation_walk.py 2>/dev/null | grep -E '^(defaults|guided):' | sed 's/^/  /')
done

timed() {  # timed LABEL TREE PYTEST-ARGS...
  local label=$1 tree=$2 began=$SECONDS
  shift 2
  local last
  last=$(cd "$tree" && PYTHONPATH="$tree" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -1)
  echo "$label $(basename "$tree"): $((SECONDS - began)) s: $last"
}
for tree in "${trees[@]}"; do timed "fast lane" "$tree" -m "not slow"; done
if [[ "$SUITE" != "--no-suite" ]]; then
  for tree in "${trees[@]}"; do timed "suite" "$tree"; done
fi
