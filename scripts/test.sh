#!/usr/bin/env bash
# The whole test suite on this machine: the Rust tests (host backend unless
# GLAKE_TEST_BACKEND=cuda), lints, and the header check.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --all-targets --locked
