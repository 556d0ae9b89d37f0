#!/usr/bin/env bash
# Runs the bundled tests and examples on the CUDA backend (on a GPU machine). Results go to
# $OUT (or ./gpu-results) as one log per step and a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export GLAKE_TEST_BACKEND=cuda RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
summary="$out/summary.txt"
: > "$summary"
status=0
for t in gpu-bundle/test-*; do
  name=$(basename "$t")
  if "$t" --test-threads=1 > "$out/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "$name: $r $(grep -E '^test result' "$out/$name.log" | tail -1)" | tee -a "$summary"
done
if ./gpu-bundle/quickstart > "$out/quickstart.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
echo "quickstart: $r" | tee -a "$summary"
exit $status
