#!/usr/bin/env python3
"""Fragmentation benchmark on real training: each workload of bench/workloads.py under
PyTorch's native allocator, expandable_segments:True and glake, each run in its own process
with the same seed (same model, same sequence of shapes).

    python3 bench/train_bench.py                          # every workload, every allocator
    python3 bench/train_bench.py --workloads opt-lora --allocators native,glake --steps 10
    python3 bench/train_bench.py --markdown results.md --jsonl results.jsonl
    python3 bench/train_bench.py --allocators 'native,glake,glake[GLAKE_FRAG_LIMIT=64M]'

An allocator may carry environment settings in brackets, separated by ';'. With --rounds N
every workload runs N rounds, the order of the allocators rotating each round (the first
process of a round tends to run slow), and each run is compared with the native run of its
own round.

Per run: peak allocated and peak requested bytes and peak reserved bytes from the allocator's
statistics (torch.cuda.memory_stats(); glake answers through its Python package), the driver's
view (largest `total - free` of cudaMemGetInfo after a step, less what was in use before the
model was built), utilization (peak allocated / peak reserved, the usual figure, and peak
requested / peak reserved, which does not depend on how each allocator rounds), and the median
step time (each step ends with a device synchronisation; the first steps are warm-up and left
out), the median of step-by-step ratios to the native run (step i has the same shapes in every
run), and the time of all steps after warm-up. glake runs also report its stitch counters.
"""
import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ALLOCATORS = ("native", "expandable", "glake")
DEFAULT_STEPS = {"opt-lora": 30, "llama-ft": 25, "moe": 25, "generate": 8, "mix": 25}
WARMUP = 3
GIB = 2**30


def child(allocator, workload, steps, seed):
    """Runs one (allocator, workload) pair in this process and prints one JSON line."""
    if allocator == "glake":
        sys.path.insert(0, str(HERE.parent / "python"))
        import glake.torch

        glake.torch.enable()
    import torch

    sys.path.insert(0, str(HERE))
    import workloads

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    baseline = total - free
    rng = random.Random(seed)
    torch.manual_seed(seed)
    step = workloads.WORKLOADS[workload]()
    times, driver_peak, stitches = [], 0, []
    for _ in range(steps):
        began = time.perf_counter()
        step(rng)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
        free, total = torch.cuda.mem_get_info()
        driver_peak = max(driver_peak, total - free - baseline)
        if allocator == "glake":
            stitches.append(torch.cuda.memory_stats().get("glake.stitches", 0))
    stats = torch.cuda.memory_stats()
    result = {
        "workload": workload,
        "allocator": allocator,
        "steps": steps,
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_requested": stats["requested_bytes.all.peak"],
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "driver_peak": driver_peak,
        "median_ms": statistics.median(times[WARMUP:] if steps > WARMUP else times),
        "step_ms": [round(t, 1) for t in times],
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
    }
    if allocator == "glake":
        result["stitches_per_step"] = [b - a for a, b in zip([0] + stitches, stitches)]
        for key in ("glake.stitches", "glake.stitch_reuse_hits", "glake.stitched_allocations",
                    "glake.stitched_mapped_bytes.peak", "num_device_alloc"):
            result[key] = stats.get(key, 0)
    print("RESULT " + json.dumps(result), flush=True)


def parse_allocator(spec):
    """("glake", {"GLAKE_MAP_THREADS": "8"}) from "glake[GLAKE_MAP_THREADS=8]"."""
    name, _, rest = spec.partition("[")
    settings = dict(item.split("=", 1) for item in rest.rstrip("]").split(";") if item)
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {spec!r}")
    return name, settings


def run(spec, workload, steps, seed):
    allocator, settings = parse_allocator(spec)
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(settings)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    command = [sys.executable, __file__, "--child", allocator, workload, "--steps", str(steps),
               "--seed", str(seed)]
    began = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["allocator"] = spec
            result["wall_s"] = round(time.time() - began, 1)
            return result
    tail = (done.stdout + done.stderr)[-3000:]
    return {"workload": workload, "allocator": spec, "error": f"exit {done.returncode}: {tail}"}


def table(results):
    lines = [
        "| workload | allocator | peak allocated GiB | peak requested GiB | peak reserved GiB "
        "| driver peak GiB | utilization (alloc/res) | utilization (req/res) | median step ms "
        "| x native | step-by-step x native | steps after warm-up s | x native |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    native = {(r["workload"], r.get("round", 0)): r for r in results
              if r["allocator"] == "native" and "error" not in r}
    for r in results:
        name = r["allocator"] + (f" (round {r['round']})" if "round" in r else "")
        if "error" in r:
            lines.append(f"| {r['workload']} | {name} | failed | | | | | | | | | | |")
            continue
        base = native.get((r["workload"], r.get("round", 0)))
        ratio = f"{r['median_ms'] / base['median_ms']:.3f}" if base else ""
        # Step i has the same shapes in every run (same seed): the median of per-step ratios
        # is far less noisy than the ratio of medians.
        paired = (f"{statistics.median(a / b for a, b in zip(r['step_ms'][WARMUP:], base['step_ms'][WARMUP:])):.3f}"
                  if base else "")
        total = sum(r["step_ms"][WARMUP:]) / 1e3
        total_ratio = f"{total * 1e3 / sum(base['step_ms'][WARMUP:]):.3f}" if base else ""
        lines.append(
            f"| {r['workload']} | {name} | {r['peak_allocated'] / GIB:.2f} "
            f"| {r['peak_requested'] / GIB:.2f} | {r['peak_reserved'] / GIB:.2f} "
            f"| {r['driver_peak'] / GIB:.2f} | {r['peak_allocated'] / r['peak_reserved']:.3f} "
            f"| {r['peak_requested'] / r['peak_reserved']:.3f} | {r['median_ms']:.0f} | {ratio} "
            f"| {paired} "
            f"| {total:.2f} | {total_ratio} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="opt-lora,llama-ft,moe,generate")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--steps", type=int, help="steps per run (default: per workload)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds per workload, the allocator order rotating each round")
    parser.add_argument("--jsonl", help="append every run's result to this file")
    parser.add_argument("--markdown", help="write the table to this file")
    parser.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "WORKLOAD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        allocator, workload = args.child
        child(allocator, workload, args.steps or DEFAULT_STEPS[workload], args.seed)
        return
    allocators = args.allocators.split(",")
    for allocator in allocators:
        try:
            parse_allocator(allocator)
        except ValueError as err:
            parser.error(str(err))
    results = []
    for workload in args.workloads.split(","):
        for round_index in range(args.rounds):
            shift = round_index % len(allocators)
            for allocator in allocators[shift:] + allocators[:shift]:
                steps = args.steps or DEFAULT_STEPS[workload]
                result = run(allocator, workload, steps, args.seed)
                if args.rounds > 1:
                    result["round"] = round_index
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as out:
                        out.write(json.dumps(result) + "\n")
    text = table(results)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
