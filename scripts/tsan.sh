#!/usr/bin/env bash
# The library's concurrent tests under ThreadSanitizer: the pool shared by many threads
# (tests/pool.rs, tests/properties.rs), the copy engine's lanes and concurrent copies
# (tests/transfer.rs), and swaps and sleep/wake over the host backend's stream threads
# (tests/swap_memory.rs, tests/sleep.rs). Rust's ThreadSanitizer needs a nightly compiler that
# rebuilds the standard library instrumented (-Zsanitizer=thread -Zbuild-std, rust-src
# component): only then are the standard library's locks and channels visible to it. Building
# C or C++ tests with -fsanitize=thread against the stable library is no substitute: the
# library's synchronisation is invisible there, and every hand-over between its threads reads
# as a race. Any report fails the run. Skipped, saying why, where no such toolchain is installed.
#   bash scripts/tsan.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "skipped: no nightly toolchain (rustup toolchain install nightly --component rust-src)"
  exit 0
fi
if ! rustup +nightly component list --installed 2>/dev/null | grep -q '^rust-src'; then
  echo "skipped: the nightly toolchain lacks rust-src (rustup component add rust-src --toolchain nightly)"
  exit 0
fi
target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Zsanitizer=thread" RUSTDOCFLAGS="-Zsanitizer=thread"
export CARGO_TARGET_DIR="$PWD/target/tsan"
export TSAN_OPTIONS="halt_on_error=1 report_signal_unsafe=0"
tests=(pool properties transfer swap_memory sleep)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo +nightly test -Zbuild-std --target "$target" --release -p glake "${args[@]}" -- --test-threads=2
echo "ThreadSanitizer: no reports in ${tests[*]}"
