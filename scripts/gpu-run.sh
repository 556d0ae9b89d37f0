#!/usr/bin/env bash
# Runs the bundled tests and examples on the CUDA backend (on a GPU machine). Results go to
# $OUT (or ./gpu-results): summary.txt, logs.txt (every step's output) and gpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export GLAKE_TEST_BACKEND=cuda RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
summary="$out/summary.txt"
# The summary names the GPU it ran on: results differ between kinds (memory totals, speeds).
sed 's/^/gpu: /' "$out/gpu.txt" > "$summary"
logs=$(mktemp -d)
status=0
for t in gpu-bundle/test-*; do
  name=$(basename "$t")
  if "$t" --test-threads=1 > "$logs/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "$name: $r $(grep -E '^test result' "$logs/$name.log" | tail -1)" | tee -a "$summary"
done
export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for t in gpu-bundle/glake_tests_static gpu-bundle/glake_tests_shared; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  if "$t" > "$logs/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "$name: $r $(grep -E '^\[  (PASSED|FAILED) ' "$logs/$name.log" | tr '\n' ' ')" | tee -a "$summary"
done
for e in gpu-bundle/c-*; do
  [ -x "$e" ] || continue
  name=$(basename "$e")
  if "$e" > "$logs/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "$name: $r ($(head -1 "$logs/$name.log"))" | tee -a "$summary"
done
if ./gpu-bundle/quickstart > "$logs/quickstart.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
echo "quickstart: $r" | tee -a "$summary"
# Trace replay on the GPU: the same allocator, real driver calls; the JSON rows also replay
# without growing idle stitched ranges in place, so that the driver time it saves is measured
# in the same call.
if [ -x gpu-bundle/glake-replay ]; then
  if ./gpu-bundle/glake-replay --backend cuda --driver-calls traces/*.txt.gz > "$logs/replay-cuda.log" 2>&1 &&
     ./gpu-bundle/glake-replay --backend cuda --json --config caching,stitch,stitch-nogrow \
       traces/*.txt.gz > "$out/replay-cuda.jsonl" 2>> "$logs/replay-cuda.log"; then
    r=ok
  else
    r=FAILED; status=1
  fi
  echo "replay (cuda): $r" | tee -a "$summary"
fi
for f in "$logs"/*.log; do
  printf '\n===== %s =====\n' "$(basename "$f" .log)"
  cat "$f"
done > "$out/logs.txt"
exit $status
