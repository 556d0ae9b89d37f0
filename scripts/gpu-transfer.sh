#!/usr/bin/env bash
# The transfer benchmark on a GPU machine, with the binary from gpu-bundle/ (scripts/gpu-bundle.sh):
# the driver's copies against glake's engine, H2D and D2H, pageable and pinned, 4 KiB to 4 GiB.
# Extra arguments go to glake-copy-bench (for example --sizes 64M,1G --peers 0). Results go to
# $OUT (or ./gpu-results): transfer.md (the table), transfer.jsonl, transfer-topology.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader
  nvidia-smi topo -m
  echo "cpus: $(nproc)"
  lscpu 2>/dev/null | grep -E "Model name|Socket|NUMA node|L3"
  ldd --version 2>/dev/null | head -1
} > "$out/transfer-topology.txt" 2>&1
sed 's/^/gpu: /' "$out/transfer-topology.txt" | head -3
./gpu-bundle/glake-copy-bench --backend cuda --json "$out/transfer.jsonl" "$@" \
  2> "$out/transfer-log.txt" | tee "$out/transfer.md"
status=${PIPESTATUS[0]}
cat "$out/transfer-log.txt"
exit "$status"
