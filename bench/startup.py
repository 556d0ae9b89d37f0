"""What enabling glake costs a program at start-up: the wall time of a whole process that
imports torch and makes its first CUDA tensor, run --runs times each (interleaved, so the
machine's drift falls on all alike):

    plain      PyTorch's own allocator
    enable     glake.torch.enable() at the top of the program (native path, built allocator cached)
    launcher   the same program, unmodified, under `python -m glake.run`
    pluggable  glake.torch.enable() with GLAKE_NATIVE=0 (CUDAPluggableAllocator)

Also times one build of the native allocator into an empty cache (what the first enable() on a
machine pays). Prints a table; --jsonl writes the raw times.

    python3 bench/startup.py --runs 7
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
PYTHON = HERE.parent / "python"

PROGRAM = "import torch\nx = torch.ones(1 << 20, device='cuda')\ntorch.cuda.synchronize()\n"
ENABLE = "import glake.torch\nglake.torch.enable()\n"


def timed(command, env):
    began = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp())
    plain, enabled = work / "plain.py", work / "enabled.py"
    plain.write_text(PROGRAM)
    enabled.write_text(ENABLE + PROGRAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON), env.get("PYTHONPATH")]))
    env.pop("GLAKE_ENABLE", None)
    variants = {
        "plain": ([sys.executable, str(plain)], env),
        "enable": ([sys.executable, str(enabled)], env),
        "launcher": ([sys.executable, "-m", "glake.run", str(plain)], env),
        "pluggable": ([sys.executable, str(enabled)], dict(env, GLAKE_NATIVE="0")),
    }
    build_env = dict(env, GLAKE_CACHE=str(work / "cache"))
    build_s = timed([sys.executable, "-m", "glake.native"], build_env)
    timed(variants["enable"][0], env)  # the cache the runs use is filled
    times = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, (command, variant_env) in variants.items():
            times[name].append(timed(command, variant_env))
    base = statistics.median(times["plain"])
    print("| start-up | median s | min s | max s | minus plain s |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {min(values):.3f} | {max(values):.3f} | "
              f"{median - base:+.3f} |")
    print(f"\nnative allocator build into an empty cache: {build_s:.1f} s")
    if args.jsonl:
        with open(args.jsonl, "w") as out:
            out.write(json.dumps({"runs": times, "build_s": build_s}) + "\n")


if __name__ == "__main__":
    main()
