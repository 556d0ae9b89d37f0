#!/usr/bin/env bash
# Builds the CMake package, installs it into build/install, copies it to build/relocated (the
# package must work from wherever it is copied to), and builds the C examples and the C++ tests
# against that copy. Used by scripts/test.sh, and by scripts/gpu-bundle.sh so the bundle never
# carries a stale libglake.so.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build/install build/relocated
cmake -S cmake -B build/glake -DCMAKE_BUILD_TYPE=Release
cmake --build build/glake
cmake --install build/glake --prefix build/install
cp -a build/install build/relocated
prefix="$PWD/build/relocated"
cmake -S c_examples -B build/c_examples -DCMAKE_PREFIX_PATH="$prefix"
cmake --build build/c_examples
cmake -S cpp_tests -B build/cpp_tests -DCMAKE_PREFIX_PATH="$prefix"
cmake --build build/cpp_tests -j 2
