#!/usr/bin/env bash
# The whole test suite on this machine: the Rust tests of the workspace (host backend unless
# GLAKE_TEST_BACKEND=cuda; the PyTorch plug-in's ABI test included), lints, the header check,
# the CMake package with the C and C++ consumers, and the Python package (wheel and host tests).
# GPU tests: scripts/gpu-run.sh and scripts/gpu-torch.sh on a GPU machine.
# On a fresh machine it first installs what is missing (scripts/setup.sh: as root it installs,
# otherwise it says which command to run).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/setup.sh
source scripts/setup.sh
setup

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --workspace --all-targets --locked

echo "== ThreadSanitizer over the concurrent tests (nightly toolchain)"
bash scripts/tsan.sh

echo "== CMake package: build, install, relocate; C examples and C++ tests against it"
bash scripts/package.sh
prefix="$PWD/build/relocated"
ctest --test-dir build/c_examples --output-on-failure
ctest --test-dir build/cpp_tests --output-on-failure

echo "== C++ tests with AddressSanitizer and UndefinedBehaviorSanitizer"
if echo 'int main(void){return 0;}' | c++ -x c++ -fsanitize=address,undefined - -o build/asan_probe 2>/dev/null; then
  cmake -S cpp_tests -B build/cpp_tests_asan -DCMAKE_PREFIX_PATH="$prefix" -DGLAKE_SANITIZE=ON
  cmake --build build/cpp_tests_asan -j 2 --target glake_tests_shared
  build/cpp_tests_asan/glake_tests_shared --gtest_brief=1
else
  echo "skipped: the C++ compiler here has no ASan/UBSan runtime"
fi

echo "== C examples and C++ tests under valgrind memcheck"
if command -v valgrind >/dev/null 2>&1; then
  for bin in build/c_examples/{alloc_free,fragment_stitch,multi_stream,sleep_wake,smartswap,snapshot,transfer} \
    build/cpp_tests/glake_tests_shared; do
    GLAKE_EXAMPLE_SLEEP_MIB=16 valgrind -q --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite "$bin" >/dev/null
    echo "valgrind clean: $bin"
  done
else
  echo "skipped: no valgrind (scripts/setup.sh installs it when run as root)"
fi

echo "== pkg-config"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
# shellcheck disable=SC2046
cc -std=c99 -Wall -Werror c_examples/alloc_free.c $(pkg-config --cflags --libs glake) \
  -Wl,-rpath,"$prefix/lib" -o build/alloc_free_pkgconfig
build/alloc_free_pkgconfig
# Static: libglake.a plus the system libraries pkg-config lists as private.
# shellcheck disable=SC2046
cc -std=c99 -Wall -Werror c_examples/alloc_free.c $(pkg-config --cflags glake) \
  -Wl,-Bstatic $(pkg-config --libs glake) -Wl,-Bdynamic \
  $(pkg-config --static --libs-only-l glake | sed 's/-lglake//') -o build/alloc_free_static
build/alloc_free_static
echo "== Python package: wheel with libgmlake.so, host tests"
rm -rf build/wheel
python3 -m pip wheel -q --no-deps --no-build-isolation -w build/wheel ./python
wheel_list=$(python3 -m zipfile -l build/wheel/glake-*-py3-none-*.whl)
for f in glake/libgmlake.so glake/swap/executor.py glake/native/glake_allocator.cpp glake/native/own_allocator_pools.h glake/native/glake.h glake/_boot/sitecustomize.py glake-autoload.pth; do
  grep -q "$f" <<<"$wheel_list" || { echo "the wheel lacks $f" >&2; exit 1; }
done
GLAKE_LIBRARY="$PWD/target/release/libgmlake.so" python3 -m pytest -q python/tests/test_package.py python/tests/test_launch.py python/tests/test_swap_search.py python/tests/test_swap_bench.py
# SmartSwap's PyTorch side on the CPU: with the interpreter in $GLAKE_TORCH_PYTHON, or python3
# when it has torch (not installed here: the CUDA build of torch is several GB; the GPU suite
# runs these tests too).
torch_python=${GLAKE_TORCH_PYTHON:-python3}
if "$torch_python" -c 'import torch' 2>/dev/null; then
  echo "== SmartSwap on PyTorch (CPU)"
  GLAKE_LIBRARY="$PWD/target/release/libgmlake.so" PYTHONPATH="$PWD/python" \
    "$torch_python" -m pytest -q python/tests/torch_cpu
else
  echo "== SmartSwap on PyTorch (CPU): skipped, no torch for $torch_python (set GLAKE_TORCH_PYTHON)"
fi
echo "all tests passed"
