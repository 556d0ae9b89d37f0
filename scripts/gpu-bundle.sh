#!/usr/bin/env bash
# Builds the test binaries and examples here (release) and copies them into gpu-bundle/, so a
# GPU machine without a Rust toolchain can run them with scripts/gpu-run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-bundle && mkdir -p gpu-bundle
cargo build --release --locked -p glake -p glake-tools --examples --bins
cargo build --release --locked -p gmlake
cargo test --release --locked -p glake -p glake-tools --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"] + ("-lib" if "lib" in m["target"]["kind"] else "")
        # Build-machine checks: the header test needs cargo and the sources; the CLI tests run
        # the tools at their build-machine paths (the tools themselves are bundled).
        if name in ("header", "replay", "hotloop"):
            continue
        shutil.copy(m["executable"], "gpu-bundle/test-" + name)
'
for f in target/release/examples/quickstart; do cp "$f" gpu-bundle/; done
# C examples and C++ tests against the installed package, rebuilt when scripts/test.sh has
# configured them (it installs what CMake needs).
if [ -d build/cpp_tests ] && [ -d build/c_examples ]; then
  bash scripts/package.sh > /dev/null
  mkdir -p gpu-bundle/lib
  cp -a build/relocated/lib/libglake.so* gpu-bundle/lib/
  cp build/cpp_tests/glake_tests_static build/cpp_tests/glake_tests_shared gpu-bundle/
  for e in alloc_free fragment_stitch multi_stream sleep_wake smartswap snapshot transfer; do cp "build/c_examples/$e" "gpu-bundle/c-$e"; done
else
  echo "run scripts/test.sh first to include the C examples and C++ tests" >&2
fi
# The PyTorch plug-in, and pytest for its GPU tests (the GPU machine may lack it).
mkdir -p gpu-bundle/lib gpu-bundle/wheels
cp target/release/libgmlake.so gpu-bundle/lib/
python3 -m pip download -q --no-deps --only-binary=:all: -d gpu-bundle/wheels \
  pytest==8.3.4 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2 ||
  echo "pytest wheels not downloaded: the GPU machine's own pytest will be needed" >&2
# The sleep benchmark's peer.
python3 -m pip download -q --no-deps --only-binary=:all: -d gpu-bundle/wheels \
  torch_memory_saver==0.0.10 ||
  echo "torch_memory_saver not downloaded: the sleep benchmark will run glake alone" >&2
find target/release -maxdepth 1 -type f -executable -name 'glake-*' -exec cp {} gpu-bundle/ \;
# Symbols too: the bundle travels to the GPU machine with a size limit.
strip --strip-unneeded gpu-bundle/* gpu-bundle/lib/* 2>/dev/null || true
du -sh gpu-bundle
