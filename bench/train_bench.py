#!/usr/bin/env python3
"""Fragmentation benchmark on real training: each workload of bench/workloads.py under
PyTorch's native allocator, expandable_segments:True and glake, each run in its own process
with the same seed (same model, same sequence of shapes).

    python3 bench/train_bench.py                          # every workload, every allocator
    python3 bench/train_bench.py --workloads opt-lora --allocators native,glake --steps 10
    python3 bench/train_bench.py --markdown results.md --jsonl results.jsonl
    python3 bench/train_bench.py --allocators 'native,glake,glake[GLAKE_FRAG_LIMIT=64M]'
    python3 bench/train_bench.py --workloads moe,generate --lockstep --rounds 2

An allocator may carry environment settings in brackets, separated by ';'
(`glake[GLAKE_NATIVE=0]`: glake through CUDAPluggableAllocator; `native[BENCH_MEMORY_HISTORY=1]`:
with memory history recorded, stacks included). With --rounds N
every workload runs N rounds, the order of the allocators rotating each round (the first
process of a round tends to run slow), and each run is compared with the native run of its
own round.

Per run: peak allocated and peak requested bytes and peak reserved bytes from the allocator's
statistics (torch.cuda.memory_stats(); glake answers through its Python package), the driver's
view (largest `total - free` of cudaMemGetInfo after a step, less what was in use before the
model was built), utilization (peak allocated / peak reserved, the usual figure, and peak
requested / peak reserved, which does not depend on how each allocator rounds), the median
step time (each step ends with a device synchronisation; the first steps are warm-up and left
out), the median of step-by-step ratios to the native run (step i has the same shapes in every
run), the time of all steps after warm-up, the process's CPU time per step (less sensitive to
other load on the machine than the wall clock) and the allocations per step. glake runs also
report its stitch counters, and with GLAKE_TIME_CALLS=1 in their settings the time spent
inside glake's malloc and free per step.

With --lockstep the allocators' processes run side by side, one step each in turn (the order
rotating every step), so that slow drifts of the machine (clocks, other load) fall on all of
them alike, and the driver's view is not reported (cudaMemGetInfo sees every process). Their
memory must fit on the GPU together: a workload whose processes would not, by the peaks
measured on an H200 (PEAK_GIB: llama-ft, mix and lora-vocab on one H200), runs one allocator
after another, and says so.

Child processes are pinned to the CPUs next to the GPU (when sysfs tells which), so that no
run pays for launching kernels from the far socket. With several rounds, a second table gives,
per workload and allocator, the median of all per-step ratios pooled over the rounds.
"""
import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ALLOCATORS = ("native", "expandable", "glake")
DEFAULT_STEPS = {"opt-lora": 30, "llama-ft": 25, "moe": 25, "generate": 8, "mix": 25, "vision": 40,
                 "lora-vocab": 25}
WARMUP = 3
GIB = 2**30
# Peak reserved GiB measured on one H200 (BENCHMARKS.md, "Allocator v2"): PyTorch's native
# allocator, and the larger of expandable_segments' and glake's (every allocator but native is
# counted at it). In lock step every allocator's process holds its memory at once; a workload
# whose processes would not fit the GPU together runs one allocator after another instead.
PEAK_GIB = {"opt-lora": (62.0, 27.2), "llama-ft": (126.5, 79.5), "moe": (16.6, 15.2),
            "generate": (2.9, 2.7), "mix": (133.6, 63.2), "vision": (11.6, 8.4),
            "lora-vocab": (130.5, 69.5)}


def child(allocator, workload, steps, seed, lockstep=False):
    """Runs one (allocator, workload) pair in this process and prints one JSON line. In lock
    step it prints READY once the model is built, then runs one step per line read from stdin
    and prints STEP_DONE after each."""
    if allocator == "glake":
        sys.path.insert(0, str(HERE.parent / "python"))
        import glake.torch

        glake.torch.enable()
    import torch

    sys.path.insert(0, str(HERE))
    import workloads

    torch.cuda.init()
    if os.environ.get("BENCH_MEMORY_HISTORY") == "1":
        # What recording memory history (alloc/free events with Python stacks, for memory_viz)
        # costs a training step, with PyTorch's allocator or glake's.
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    free, total = torch.cuda.mem_get_info()
    baseline = total - free
    rng = random.Random(seed)
    torch.manual_seed(seed)
    step = workloads.WORKLOADS[workload]()
    timing = allocator == "glake" and glake.torch.call_times()["enabled"]
    times, cpu_times, driver_peak, stitches, allocs, inside = [], [], 0, [], [], []
    if lockstep:
        print("READY", flush=True)
    for _ in range(steps):
        if lockstep and not sys.stdin.readline():
            return
        began, cpu_began = time.perf_counter(), time.process_time()
        step(rng)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
        cpu_times.append((time.process_time() - cpu_began) * 1e3)
        free, total = torch.cuda.mem_get_info()
        driver_peak = max(driver_peak, total - free - baseline)
        stats = torch.cuda.memory_stats()
        allocs.append(stats.get("allocation.all.allocated", 0))
        if allocator == "glake":
            stitches.append(stats.get("glake.stitches", 0))
        if timing:
            calls = glake.torch.call_times()
            inside.append(calls["malloc_ns"] + calls["free_ns"])
        if lockstep:
            print("STEP_DONE", flush=True)
    stats = torch.cuda.memory_stats()
    result = {
        "workload": workload,
        "allocator": allocator,
        "steps": steps,
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_requested": stats["requested_bytes.all.peak"],
        "peak_reserved": stats["reserved_bytes.all.peak"],
        # In lock step the other processes' memory is in cudaMemGetInfo's figures too.
        "driver_peak": None if lockstep else driver_peak,
        "median_ms": statistics.median(times[WARMUP:] if steps > WARMUP else times),
        "step_ms": [round(t, 1) for t in times],
        "cpu_ms": [round(t, 1) for t in cpu_times],
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
        "allocs_per_step": per_step(allocs),
    }
    if timing:
        result["allocator_ms_per_step"] = [round(ns / 1e6, 2) for ns in per_step(inside)]
    if allocator == "glake":
        result["stitches_per_step"] = per_step(stitches)
        for key in ("glake.stitches", "glake.stitch_reuse_hits", "glake.stitched_allocations",
                    "glake.stitched_mapped_bytes.peak", "glake.gathered_segments",
                    "glake.gathered_handles", "num_device_alloc"):
            result[key] = stats.get(key, 0)
    print("RESULT " + json.dumps(result), flush=True)


def per_step(totals):
    """Per-step increments of a running total read after each step."""
    return [b - a for a, b in zip([0] + totals, totals)]


def gpu_local_cpus():
    """The CPUs on the GPU's side of the machine that this process may use, or None."""
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader",
                              "-i", "0"], capture_output=True, text=True, check=True)
        bus_id = bus.stdout.strip().lower()
        domain, rest = bus_id.split(":", 1)
        path = pathlib.Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/local_cpulist")
        cpus = set()
        for part in path.read_text().strip().split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        usable = cpus & os.sched_getaffinity(0)
        return usable or None
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def parse_allocator(spec):
    """("glake", {"GLAKE_MAP_THREADS": "8"}) from "glake[GLAKE_MAP_THREADS=8]"."""
    name, _, rest = spec.partition("[")
    settings = dict(item.split("=", 1) for item in rest.rstrip("]").split(";") if item)
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {spec!r}")
    return name, settings


def child_command(spec, workload, steps, seed, lockstep=False):
    """The command line and environment of the child process that runs `spec`."""
    allocator, settings = parse_allocator(spec)
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(settings)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    command = [sys.executable, __file__, "--child", allocator, workload, "--steps", str(steps),
               "--seed", str(seed)] + (["--lockstep"] if lockstep else [])
    return command, env


def parse_result(stdout, spec, began, cpus):
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["allocator"] = spec
            result["wall_s"] = round(time.time() - began, 1)
            result["cpus"] = len(cpus) if cpus else None
            return result
    return None


def pinning(cpus):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def run(spec, workload, steps, seed, cpus):
    command, env = child_command(spec, workload, steps, seed)
    began = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          preexec_fn=pinning(cpus))
    result = parse_result(done.stdout, spec, began, cpus)
    if result is not None:
        return result
    tail = (done.stdout + done.stderr)[-3000:]
    return {"workload": workload, "allocator": spec, "error": f"exit {done.returncode}: {tail}"}


def gpu_memory_gib():
    """The GPU's memory in GiB as nvidia-smi reports it (None when it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, check=True).stdout
        return int(out.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.CalledProcessError):
        return None


def lockstep_gib(workload, specs):
    """The GiB the processes of `specs` would hold together in lock step on `workload`, from
    PEAK_GIB (None for a workload not measured)."""
    peaks = PEAK_GIB.get(workload)
    if peaks is None:
        return None
    return sum(peaks[0] if parse_allocator(spec)[0] == "native" else peaks[1] for spec in specs)


def wait_for(process, token):
    """Reads the child's output up to a line equal to `token`; False at end of output."""
    for line in process.stdout:
        if line.strip() == token:
            return True
    return False


def run_lockstep(specs, workload, steps, seed, cpus):
    """Runs every allocator of `specs` in its own process at the same time, one step at a time
    in turn (the order rotating each step), so that slow drifts of the machine (clocks, other
    load) fall on all of them alike. The processes' memory must fit on the GPU together."""
    began = time.time()
    children = []
    for spec in specs:
        command, env = child_command(spec, workload, steps, seed, lockstep=True)
        errors = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=errors, text=True,
                                   preexec_fn=pinning(cpus))
        alive = wait_for(process, "READY")
        children.append({"spec": spec, "process": process, "errors": errors, "alive": alive})
    for step in range(steps):
        shift = step % len(children)
        for c in children[shift:] + children[:shift]:
            if not c["alive"]:
                continue
            try:
                c["process"].stdin.write("STEP\n")
                c["process"].stdin.flush()
                c["alive"] = wait_for(c["process"], "STEP_DONE")
            except BrokenPipeError:
                c["alive"] = False
    results = []
    for c in children:
        try:
            c["process"].stdin.close()
        except BrokenPipeError:
            pass
        rest = c["process"].stdout.read()
        c["process"].wait()
        result = parse_result(rest, c["spec"], began, cpus)
        if result is None:
            c["errors"].seek(0)
            tail = (rest + c["errors"].read())[-3000:]
            result = {"workload": workload, "allocator": c["spec"],
                      "error": f"exit {c['process'].returncode}: {tail}"}
        c["errors"].close()
        result["lockstep"] = True
        results.append(result)
    return results


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
        paired = f"{statistics.median(paired_ratios(r, base)):.3f}" if base else ""
        total = sum(r["step_ms"][WARMUP:]) / 1e3
        driver = "-" if r["driver_peak"] is None else f"{r['driver_peak'] / GIB:.2f}"
        total_ratio = f"{total * 1e3 / sum(base['step_ms'][WARMUP:]):.3f}" if base else ""
        lines.append(
            f"| {r['workload']} | {name} | {r['peak_allocated'] / GIB:.2f} "
            f"| {r['peak_requested'] / GIB:.2f} | {r['peak_reserved'] / GIB:.2f} "
            f"| {driver} "
            f"| {r['peak_allocated'] / r['peak_reserved']:.3f} "
            f"| {r['peak_requested'] / r['peak_reserved']:.3f} | {r['median_ms']:.0f} | {ratio} "
            f"| {paired} "
            f"| {total:.2f} | {total_ratio} |"
        )
    return "\n".join(lines)


def paired_ratios(run, base, key="step_ms"):
    return [a / b for a, b in zip(run[key][WARMUP:], base[key][WARMUP:])]


def pooled_table(results):
    """Per workload and allocator over all rounds: the median of every per-step ratio to the
    native run of the same round, each round's median, and all steps' time against native's."""
    native = {(r["workload"], r.get("round", 0)): r for r in results
              if r["allocator"] == "native" and "error" not in r}
    groups = {}
    for r in results:
        base = native.get((r["workload"], r.get("round", 0)))
        if "error" in r or base is None or r["allocator"] == "native":
            continue
        groups.setdefault((r["workload"], r["allocator"]), []).append((r, base))
    lines = [
        "| workload | allocator | rounds | pooled step-by-step x native | per round "
        "| all steps after warm-up x native | CPU time step-by-step x native "
        "| allocations per step | allocator ms per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, allocator), pairs in groups.items():
        pooled = [x for r, b in pairs for x in paired_ratios(r, b)]
        rounds = ", ".join(f"{statistics.median(paired_ratios(r, b)):.3f}" for r, b in pairs)
        total = (sum(sum(r["step_ms"][WARMUP:]) for r, _ in pairs)
                 / sum(sum(b["step_ms"][WARMUP:]) for _, b in pairs))
        allocs = [n for r, _ in pairs for n in r.get("allocs_per_step", [])[WARMUP:]]
        inside = [ms for r, _ in pairs for ms in r.get("allocator_ms_per_step", [])[WARMUP:]]
        cpu = [x for r, b in pairs if "cpu_ms" in r and "cpu_ms" in b
               for x in paired_ratios(r, b, "cpu_ms")]
        lines.append(
            f"| {workload} | {allocator} | {len(pairs)} | {statistics.median(pooled):.3f} "
            f"| {rounds} | {total:.3f} "
            f"| {f'{statistics.median(cpu):.3f}' if cpu else ''} "
            f"| {statistics.median(allocs) if allocs else ''} "
            f"| {f'{statistics.median(inside):.2f}' if inside else ''} |"
        )
    return "\n".join(lines)


def pooled_files(paths):
    """The per-run and pooled tables of results read from `paths`. A round is known by its file
    and its index there, so that rounds of several calls pool without meeting each other's
    native runs."""
    results = []
    for number, path in enumerate(paths):
        rounds = {}
        for line in pathlib.Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            result = json.loads(line)
            if "workload" not in result or "allocator" not in result:
                continue
            key = rounds.setdefault(result.get("round", 0), len(rounds))
            result["round"] = f"{number}.{key}"
            results.append(result)
    return table(results) + "\n\n" + pooled_table(results)


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
    parser.add_argument("--lockstep", action="store_true",
                        help="run the allocators' processes side by side, one step each in turn "
                             "(their memory must fit on the GPU together)")
    parser.add_argument("--first-round", type=int, default=0,
                        help="index of the first round: a later call goes on with the rotation "
                             "of allocators where an earlier one stopped")
    parser.add_argument("--pool", nargs="+", metavar="JSONL",
                        help="run nothing: print the tables of the results in these files "
                             "(--jsonl outputs of several calls), their rounds pooled")
    parser.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "WORKLOAD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool:
        print(pooled_files(args.pool))
        return
    if args.child:
        allocator, workload = args.child
        child(allocator, workload, args.steps or DEFAULT_STEPS[workload], args.seed,
              args.lockstep)
        return
    allocators = args.allocators.split(",")
    for allocator in allocators:
        try:
            parse_allocator(allocator)
        except ValueError as err:
            parser.error(str(err))
    cpus = gpu_local_cpus()
    print(f"children pinned to {len(cpus)} CPUs near the GPU" if cpus else "children not pinned",
          flush=True)
    results = []
    total_gib = gpu_memory_gib() if args.lockstep else None
    for workload in args.workloads.split(","):
        steps = args.steps or DEFAULT_STEPS[workload]
        lockstep = args.lockstep
        need = lockstep_gib(workload, allocators) if lockstep else None
        if need is not None and total_gib is not None and need > 0.95 * total_gib:
            print(f"{workload}: its processes would hold about {need:.0f} GiB together, more "
                  f"than this GPU's {total_gib:.0f} GiB: one allocator after another", flush=True)
            lockstep = False
        for round_index in range(args.first_round, args.first_round + args.rounds):
            shift = round_index % len(allocators)
            order = allocators[shift:] + allocators[:shift]
            if lockstep:
                batch = run_lockstep(order, workload, steps, args.seed, cpus)
            else:
                batch = [run(a, workload, steps, args.seed, cpus) for a in order]
            for result in batch:
                if args.rounds > 1 or args.first_round > 0:
                    result["round"] = round_index
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as out:
                        out.write(json.dumps(result) + "\n")
    text = table(results)
    if args.rounds > 1:
        text += "\n\n" + pooled_table(results)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
