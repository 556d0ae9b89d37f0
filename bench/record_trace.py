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


_LIVE_AT_START = {}  # device -> [(addr, size, stream)]: what was allocated before start()


def _glake_snapshot(device):
    """glake's own snapshot of `device` when glake is the allocator (its blocks tell a stitched
    allocation's pieces from plain ones), else None."""
    try:
        import glake.torch
    except ImportError:
        return None
    return glake.torch.snapshot(device) if glake.torch.is_enabled() else None


def _live_blocks(device):
    """(addr, size, stream) of every live allocation of `device`. On glake, a stitched
    allocation is one allocation at its stitched range, whose pieces its segments show as
    blocks of their own."""
    glake_snap = _glake_snapshot(device)
    if glake_snap is None:
        live = []
        for segment in torch.cuda.memory._snapshot()["segments"]:
            if segment["device"] != device:
                continue
            addr = segment["address"]
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    live.append((addr, block["requested_size"] or block["size"],
                                 segment["stream"]))
                addr += block["size"]
        return live
    live, pieces = [], []
    for segment in glake_snap["segments"]:
        for block in segment["blocks"]:
            size = block["requested_size"] or block["size"]
            if block["state"] == "active_allocated":
                live.append((block["address"], size, block["stream"] or 0))
            elif block["state"] == "active_stitched":
                pieces.append(block)
    for stitched in glake_snap["stitched"]:
        if not stitched["in_use"]:
            continue
        mine = [b for b in pieces
                if any(a <= b["address"] < a + n for a, n in stitched["pieces"])]
        if mine:
            live.append((stitched["address"], sum(b["size"] for b in mine),
                         mine[0]["stream"] or 0))
    return live


def start(device=0):
    """Starts recording (anything recorded before is dropped). The blocks already allocated
    are noted, so that write() can put them first and a replay's pool holds them, as the real
    one did (a model's parameters, say)."""
    torch.cuda.memory._record_memory_history(enabled=None)
    _LIVE_AT_START.clear()
    _LIVE_AT_START[device] = _live_blocks(device)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")


def recorded(device=0):
    """How many events have been recorded since start(): a position for write()'s `marks`."""
    return len(torch.cuda.memory._snapshot()["device_traces"][device])


def write(path, device=0, marks=()):
    """Writes the events recorded since start() for `device`; returns their count. `marks`:
    (position from recorded(), text) pairs, written as `# text` comment lines at that point,
    so that a replay can be cut at them."""
    traces = torch.cuda.memory._snapshot()["device_traces"]
    pending = sorted(marks, key=lambda mark: mark[0])
    opener = gzip.open if path.endswith(".gz") else open
    count = 0
    with opener(path, "wt") as out:
        out.write("# action addr size stream\n")
        if _LIVE_AT_START.get(device):
            out.write("# allocated before the recording began\n")
        for addr, size, stream in sorted(_LIVE_AT_START.get(device, ())):
            out.write(f"alloc {addr} {size} {stream}\n")
            count += 1
        for index, e in enumerate(traces[device]):
            while pending and pending[0][0] <= index:
                out.write(f"# {pending.pop(0)[1]}\n")
            if e["action"] in ACTIONS:
                out.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")
                count += 1
        for _, text in pending:
            out.write(f"# {text}\n")
    torch.cuda.memory._record_memory_history(enabled=None)
    return count


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
