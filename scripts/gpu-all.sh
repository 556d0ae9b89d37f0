#!/usr/bin/env bash
# One full pass on a GPU machine, with gpu-bundle/ from scripts/gpu-bundle.sh: the CUDA test
# suite (gpu-run.sh), the PyTorch tests (gpu-torch.sh tests), and a short transfer benchmark
# (gpu-transfer.sh; extra arguments go to it). Each part writes under $OUT/<part>/ (or
# ./gpu-results/<part>/); the exit status is nonzero when any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
status=0
part() {
  local name=$1
  shift
  mkdir -p "$out/$name"
  local started=$SECONDS
  if OUT="$out/$name" "$@" > "$out/$name/console.txt" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "$name: $r ($((SECONDS - started)) s)"
}
part run bash scripts/gpu-run.sh
cat "$out/run/summary.txt"
part torch bash scripts/gpu-torch.sh tests
grep -E "passed|failed" "$out/torch/pytest.txt" | tail -1
part transfer bash scripts/gpu-transfer.sh --sizes "${TRANSFER_SIZES:-16M,64M,256M,1G}" "$@"
cat "$out/transfer/transfer.md"
exit $status
