#!/usr/bin/env python3
"""Records a PyTorch allocation trace in glake-replay's text format.

Runs one workload on the GPU with PyTorch's own allocator while
torch.cuda.memory._record_memory_history() records every event, then writes
`action addr size stream` lines, oldest first (gzip when the name ends in .gz):

    python3 bench/record_trace.py --workload moe --out traces/trace_moe_train.txt.gz

Workloads: those of bench/workloads.py.
To record any other PyTorch program, call start() before it and write() after it.
"""
import argparse
import gzip
import random
import time

import torch

import workloads

ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    # Segments that grow or shrink at their end (PyTorch's expandable segments).
    "segment_map",
    "segment_unmap",
)


def start():
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")


def write(path, device=0):
    """Writes the events recorded since start() for `device`; returns their count."""
    traces = torch.cuda.memory._snapshot()["device_traces"]
    events = [e for e in traces[device] if e["action"] in ACTIONS]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as out:
        out.write("# action addr size stream\n")
        for e in events:
            out.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")
    torch.cuda.memory._record_memory_history(enabled=None)
    return len(events)


WORKLOADS = tuple(workloads.WORKLOADS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    began = time.time()
    step = workloads.WORKLOADS[args.workload]()
    start()
    for _ in range(args.steps):
        step(rng)
    torch.cuda.synchronize()
    count = write(args.out)
    print(f"{args.workload}: {count} events in {time.time() - began:.1f} s -> {args.out}; "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
