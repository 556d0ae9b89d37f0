#!/usr/bin/env python3
"""Does memory from glake run kernels as fast as memory from PyTorch's own allocator, and what
does an allocation cost from Python? Each allocator runs in its own process:

    python3 bench/kernel_speed.py                 # native, expandable, glake
Per allocator: a bandwidth-bound kernel (x.mul_(1.0001) over 4 GiB) on one plain allocation,
the same on a stitched allocation (glake only: the free memory is fragmented into 64 MiB
pieces first, so that the 4 GiB request must be stitched from them), a bf16 GEMM
(8192 x 8192 x 8192) whose operands come from the same kind of memory, and torch.empty + del
pairs of mixed sizes from Python. Times are medians of repeated runs, measured with CUDA events.
"""
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
GIB = 2**30
MIB = 2**20


def timed(torch, fn, repeat=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fragmented(torch):
    """Leaves free memory only as 64 MiB holes between live 64 MiB blocks; returns the
    blocks to keep alive."""
    blocks = [torch.empty(64 * MIB, dtype=torch.uint8, device="cuda") for _ in range(160)]
    keep = blocks[::2]
    del blocks
    return keep


def child(allocator):
    if allocator == "glake":
        sys.path.insert(0, str(HERE.parent / "python"))
        import glake.torch

        glake.torch.enable()
    import torch

    result = {"allocator": allocator}
    n = 4 * GIB // 4
    x = torch.ones(n, device="cuda")
    result["stream_plain_ms"] = timed(torch, lambda: x.mul_(1.0001))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    result["gemm_plain_ms"] = timed(torch, lambda: a @ b, repeat=10)
    del x, a, b
    if allocator == "glake":
        keep = fragmented(torch)
        before = torch.cuda.memory_stats()["glake.stitches"]
        x = torch.ones(n, device="cuda")
        result["stitched"] = torch.cuda.memory_stats()["glake.stitches"] > before
        result["stream_stitched_ms"] = timed(torch, lambda: x.mul_(1.0001))
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        del keep
        result["gemm_operand_ms"] = timed(torch, lambda: a @ a, repeat=10)
        del x, a
    # Latency-bound work: a scalar read back to the host (a copy and a wait) and nonzero()
    # (which reads its count back), as routing code such as MoE layers does many times a step.
    scalar = torch.ones(1, device="cuda")
    began = time.perf_counter()
    for _ in range(2000):
        scalar.item()
    result["item_us"] = (time.perf_counter() - began) / 2000 * 1e6
    mask = torch.rand(1 << 20, device="cuda") > 0.5
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(500):
        mask.nonzero()
    torch.cuda.synchronize()
    result["nonzero_us"] = (time.perf_counter() - began) / 500 * 1e6
    small = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(20000):
        small.add_(1)
    torch.cuda.synchronize()
    result["small_kernel_us"] = (time.perf_counter() - began) / 20000 * 1e6
    sizes = [512, 4096, 65536, MIB, 3 * MIB + 512, 16 * MIB, 64 * MIB]
    torch.cuda.synchronize()
    began = time.perf_counter()
    count = 0
    for _ in range(5000):
        for size in sizes:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            del t
            count += 1
    result["empty_del_us"] = (time.perf_counter() - began) / count * 1e6
    print("RESULT " + json.dumps(result), flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    rows = []
    for allocator in ("native", "expandable", "glake"):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if allocator == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        done = subprocess.run([sys.executable, __file__, "--child", allocator], env=env,
                              capture_output=True, text=True)
        line = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(done.stdout + done.stderr)
            sys.exit(1)
        rows.append(json.loads(line[0][len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    print("| allocator | 4 GiB mul_ ms | 8192^3 bf16 GEMM ms | 4 GiB mul_ on stitched ms "
          "| GEMM on stitched-era operand ms | torch.empty+del us | .item() us | nonzero() us "
          "| small add_ us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['allocator']} | {r['stream_plain_ms']:.3f} | {r['gemm_plain_ms']:.3f} "
              f"| {r.get('stream_stitched_ms', float('nan')):.3f} "
              f"| {r.get('gemm_operand_ms', float('nan')):.3f} | {r['empty_del_us']:.2f} "
              f"| {r['item_us']:.1f} | {r['nonzero_us']:.1f} | {r['small_kernel_us']:.2f} |")


if __name__ == "__main__":
    main()
