#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian-like machine, only what is missing:
# CMake, pkg-config, a C and C++ compiler, make, GoogleTest, Python 3 with pip, pytest,
# setuptools and wheel, and rustfmt/clippy. As root it installs them (apt, then pip); otherwise
# it prints in one line the command to run and fails. Sourced or run by scripts/test.sh.
set -euo pipefail

setup_missing_packages() {
  local need=()
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
  command -v cc >/dev/null 2>&1 || need+=(gcc)
  command -v c++ >/dev/null 2>&1 || need+=(g++)
  command -v make >/dev/null 2>&1 || need+=(make)
  # GoogleTest where CMake finds it: the system headers, /usr/local, or pkg-config's.
  [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] ||
    pkg-config --exists gtest 2>/dev/null || need+=(libgtest-dev)
  command -v python3 >/dev/null 2>&1 || need+=(python3)
  # pip builds the wheel (`python3 -m pip wheel`).
  if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    need+=(python3-pip)
  fi
  echo "${need[@]}"
}

python_ready() {
  python3 -c 'import pytest, setuptools, wheel' >/dev/null 2>&1 &&
    python3 -m pip --version >/dev/null 2>&1
}

apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  local log
  log=$(mktemp)
  if apt-get update -qq >"$log" 2>&1 &&
    apt-get install -y -qq --no-install-recommends "$@" >>"$log" 2>&1; then
    rm -f "$log"
  else
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
}

setup() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: no Rust toolchain; install one with https://rustup.rs (1.85 or newer)" >&2
    return 1
  fi
  local root=0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && root=1
  local need
  read -r -a need <<<"$(setup_missing_packages)"
  if [ ${#need[@]} -gt 0 ]; then
    if [ $root = 1 ]; then
      echo "setup: installing ${need[*]}"
      apt_install "${need[@]}"
    else
      echo "setup: missing ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
      return 1
    fi
  fi
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
  # valgrind runs the C and C++ suites once more when it is there: installed as root, else the
  # test command says it skips that part.
  if ! command -v valgrind >/dev/null 2>&1 && [ $root = 1 ]; then
    echo "setup: installing valgrind"
    apt_install valgrind || true
  fi
  if ! python_ready; then
    # pip first (the python3 on PATH may not be Debian's); where the system Python refuses pip
    # installs (PEP 668), Debian's packages.
    echo "setup: installing pytest, setuptools and wheel"
    python3 -m pip install -q pytest setuptools wheel 2>/dev/null ||
      python3 -m pip install -q --break-system-packages pytest setuptools wheel 2>/dev/null ||
      { [ $root = 1 ] && apt_install python3-pytest python3-setuptools python3-wheel; } ||
      true
  fi
  if ! python_ready; then
    echo "setup: pytest, setuptools or wheel missing for python3; run: python3 -m pip install pytest setuptools wheel" >&2
    return 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  setup
fi
