#!/usr/bin/env bash
# PyTorch on the GPU machine, with the plug-in from gpu-bundle/ (scripts/gpu-bundle.sh):
#   bash scripts/gpu-torch.sh tests    # pytest python/tests/gpu (2-GPU tests skip on one GPU)
#   bash scripts/gpu-torch.sh bench    # bench/train_bench.py, every workload and allocator
#   bash scripts/gpu-torch.sh load     # bench/load_state_dict.py: a 10 GB state dict to the GPU
#   bash scripts/gpu-torch.sh swap     # bench/swap_bench.py: SmartSwap against checkpointing
#   bash scripts/gpu-torch.sh sleep    # bench/sleep_bench.py: sleep/wake against torch_memory_saver
#   bash scripts/gpu-torch.sh dedup    # bench/dedup_bench.py: N replicas with and without dedup
#   bash scripts/gpu-torch.sh all      # tests and bench (the default)
# Extra arguments after the first go to train_bench.py. Results go to $OUT (or ./gpu-results):
# pytest.txt, bench.jsonl, bench.md, swap.md, swap.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
what=${1:-all}
shift || true
export GLAKE_LIBRARY="$PWD/gpu-bundle/lib/libgmlake.so" PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c 'import pytest' 2>/dev/null && ls gpu-bundle/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/glake-site gpu-bundle/wheels/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/glake-site"
fi
# The GPU these results come from (kinds differ in memory and speed).
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 |
  sed 's/^/gpu: /' | tee "$out/gpu.txt"
# glake's native PyTorch allocator, built once for this torch into the cache enable() uses (a
# failed build shows here; enable() then falls back to the pluggable path and says why).
python3 -m glake.native 2>&1 | tail -3 | sed 's/^/native allocator: /' | tee "$out/native.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -v -rs python/tests/gpu python/tests/torch_cpu 2>&1 | tee "$out/pytest.txt" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/train_bench.py --jsonl "$out/bench.jsonl" --markdown "$out/bench.md" "$@" || status=1
fi
if [ "$what" = swap ]; then
  python3 bench/swap_bench.py --markdown "$out/swap.md" --jsonl "$out/swap.jsonl" "$@" || status=1
fi
if [ "$what" = sleep ]; then
  # torch_memory_saver, the peer, from the wheel gpu-bundle.sh fetched (the machine is offline).
  if ! python3 -c 'import torch_memory_saver' 2>/dev/null && ls gpu-bundle/wheels/torch_memory_saver-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/glake-tms gpu-bundle/wheels/torch_memory_saver-*.whl &&
      export PYTHONPATH="$PYTHONPATH:/tmp/glake-tms"
  fi
  python3 bench/sleep_bench.py --markdown "$out/sleep.md" --jsonl "$out/sleep.jsonl" "$@" || status=1
fi
if [ "$what" = dedup ]; then
  python3 bench/dedup_bench.py --markdown "$out/dedup.md" --jsonl "$out/dedup.jsonl" "$@" || status=1
fi
if [ "$what" = load ]; then
  python3 bench/load_state_dict.py --markdown "$out/load.md" --jsonl "$out/load.jsonl" "$@" || status=1
fi
exit $status
