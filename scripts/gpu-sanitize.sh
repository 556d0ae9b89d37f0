#!/usr/bin/env bash
# compute-sanitizer over the CUDA test suite, on a GPU machine with gpu-bundle/ from
# scripts/gpu-bundle.sh: memcheck (device accesses out of bounds or to freed or unmapped
# memory, driver API errors, device memory leaks) over every test binary, the C examples and
# the C++ suite; racecheck and synccheck over the C++ suite and the PyTorch tests of glake's
# allocator (the kernels there are PyTorch's, on glake's memory). A run fails on any error the
# tool reports. Results in $OUT (or ./gpu-results): sanitize.txt and one log per run.
#   bash scripts/gpu-sanitize.sh            # everything
#   SANITIZE_TORCH=0 bash scripts/gpu-sanitize.sh   # without the PyTorch part
#   SANITIZE_PARTS=torch bash scripts/gpu-sanitize.sh  # parts: rust c cpp torch (default all)
#   SANITIZE_TORCH_CHECKS=memcheck ...                 # the PyTorch part's checks (default both)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out/sanitize-logs"
tool=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
summary="$out/sanitize.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 |
  sed 's/^/gpu: /' > "$summary"
if [ ! -x "$tool" ]; then
  echo "no compute-sanitizer on this machine" | tee -a "$summary"
  exit 1
fi
"$tool" --version | tail -1 | sed 's/^/tool: /' | tee -a "$summary"
export GLAKE_TEST_BACKEND=cuda RUST_BACKTRACE=1
export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
# run <check> <name> <command...>: one program under one check. "no CUDA calls" is a program
# that ran only on the host backend; on failure the distinct error headlines follow, counted.
# API errors: test programs call the driver wrongly on purpose (misuse and fault tests), so
# RUN_API_ERRORS=no there; the examples must make none.
run() {
  local check=$1 name=$2
  shift 2
  local log="$out/sanitize-logs/$check-$name.log"
  local extra=()
  [ "$check" = memcheck ] && extra=(--leak-check "${LEAK_CHECK:-full}" --check-api-memory-access yes)
  extra+=(--report-api-errors "${RUN_API_ERRORS:-explicit}")
  if timeout "${SANITIZE_TIMEOUT_S:-600}" "$tool" --tool "$check" "${extra[@]}" \
    --error-exitcode 9 --target-processes all "$@" > "$log" 2>&1; then r=ok; else r="FAILED (exit $?)"; status=1; fi
  if grep -q "terminated before first instrumented API call" "$log" && ! grep -q "test result: FAILED" "$log"; then
    r="ok (no CUDA calls)"
  fi
  echo "$check $name: $r $(grep -E 'ERROR SUMMARY' "$log" | tail -1)" | tee -a "$summary"
  case $r in
    ok*) ;;
    *) grep -E '^========= (Invalid|Program hit|Leaked|Race|Barrier|Uninitialized|Error)|^test .* FAILED|^(FAILED|ERROR) |^E   |panicked at' "$log" |
      sed -E 's/0x[0-9a-f]+/ADDR/g; s/\(error [0-9]+\)//' | sort | uniq -c | sort -rn | head -12 |
      sed 's/^/    /' | tee -a "$summary" ;;
  esac
}
parts=" ${SANITIZE_PARTS:-rust c cpp torch} "
[ "${SANITIZE_TORCH:-1}" = 0 ] && parts=${parts/ torch / }
part() { [[ $parts == *" $1 "* ]]; }
part rust && for t in gpu-bundle/test-*; do
  name=$(basename "$t")
  # Build-machine checks (see gpu-run.sh), and the guard tests, whose children fault on purpose.
  case $name in test-header | test-replay | test-guard) continue ;; esac
  RUN_API_ERRORS=no GLAKE_FUZZ_OPS=${GLAKE_FUZZ_OPS:-2000} run memcheck "$name" "$t" --test-threads=1
done
part c && for t in gpu-bundle/c-*; do
  [ -x "$t" ] || continue
  run memcheck "$(basename "$t")" "$t"
done
if part cpp && [ -x gpu-bundle/glake_tests_shared ]; then
  for check in memcheck racecheck synccheck; do
    RUN_API_ERRORS=no run "$check" glake_tests_shared gpu-bundle/glake_tests_shared
  done
fi
if part torch; then
  export GLAKE_UNDER_SANITIZER=1 GLAKE_LIBRARY="$PWD/gpu-bundle/lib/libgmlake.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
  if ! python3 -c 'import pytest' 2>/dev/null && ls gpu-bundle/wheels/pytest-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/glake-site gpu-bundle/wheels/*.whl &&
      export PYTHONPATH="$PYTHONPATH:/tmp/glake-site"
  fi
  python3 -m glake.native > /dev/null 2>&1 || true  # build the native allocator outside the tool
  for check in ${SANITIZE_TORCH_CHECKS:-memcheck racecheck}; do
    # No leak check: PyTorch keeps its cache (and glake's plug-in its pool) to the end of the
    # process, as the driver takes everything back at exit.
    LEAK_CHECK=no RUN_API_ERRORS=no run "$check" torch python3 -m pytest -q -x python/tests/gpu/test_torch.py python/tests/gpu/test_sleep.py \
      -k "not two_gpu and not fsdp and not ddp and not compile"
  done
fi
exit $status
