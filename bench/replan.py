#!/usr/bin/env python3
"""SmartSwap's plans simulated again away from the GPU, from the planning records that
`bench/swap_bench.py --logs DIR` writes (SmartSwap.planning_record): for each trial of the
search, the peak and step glake's simulation gives its choices on the profile as planned, and
on that profile with each block's forward (and its ops' recompute times) at the forward
warm-up timed; then the planner's own plan for the record's goal on both.

    python3 bench/replan.py bench/results/h200-swap-moe-stepbwd-0.4-2026-11-28d-oom.plan.json

The second figure tells whether a plan's peak holds if its forward runs as fast as warm-up's
did: a plan's swaps leave during the forward. Needs glake's library (GLAKE_LIBRARY or the
installed package) and torch (glake.swap imports it), no GPU.
"""
import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
from glake.swap import planner, search  # noqa: E402
from glake.swap.profiling import floored_profile  # noqa: E402

GB = 1e9


def profile(record, at_warmup_pace):
    """The record's profile; with `at_warmup_pace`, each block's forward op and the recompute
    times of its tensors brought to the forward warm-up timed where that is shorter, by the
    rule SmartSwap plans by (search.forward_scales, profiling.floored_profile; a record
    planned by it is unchanged)."""
    taken = planner.Profile(ops=[tuple(op) for op in record["ops"]],
                            tensors=[planner.Tensor(**t) for t in record["tensors"]],
                            base_bytes=record["base_bytes"])
    # Warm-up's forwards (records before they were kept apart: block_fwd_ms was warm-up's).
    timed = record.get("warmup_block_fwd_ms") or record.get("block_fwd_ms")
    if not (at_warmup_pace and timed):
        return taken
    scales = search.forward_scales([int(ms * 1e6) for ms in timed],
                                   [ns for ns, _ in taken.ops[:len(timed)]])
    return floored_profile(taken, record["meaning"], scales)


def describe(prediction):
    return f"{prediction.step_ns / 1e6:.0f} ms, peak {prediction.peak_bytes / GB:.3f} GB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="planning records (JSON)")
    args = parser.parse_args()
    for path in args.records:
        record = json.loads(pathlib.Path(path).read_text())
        as_planned, at_pace = profile(record, False), profile(record, True)
        d2h, h2d = record["bandwidth"]
        prefetch = record["prefetch"]
        budget = record["budget"]
        print(f"{path}: budget {budget / GB:.3f} GB" if budget else f"{path}: no target")
        for n, trial in enumerate(record["trials"], 1):
            kind = ("full recomputation" if trial["recompute"] else
                    "whole blocks" if trial["whole_blocks"] else "planner")
            choices = [tuple(c) for c in trial["choices"]]
            measured = [round(m["allocated"] / GB, 3) for m in trial["measured"]]
            print(f"  trial {n} ({kind}): as profiled "
                  f"{describe(planner.simulate(as_planned, choices, d2h, h2d, prefetch))}; "
                  f"at warm-up's forwards "
                  f"{describe(planner.simulate(at_pace, choices, d2h, h2d, prefetch))}; "
                  f"measured peaks {measured} GB")
        if not budget:
            continue
        goal = budget - record["correction"]
        for name, prof in (("as profiled", as_planned), ("at warm-up's forwards", at_pace)):
            try:
                choices, prediction = planner.plan(prof, goal, d2h, h2d, prefetch,
                                                   record["preference"])
            except planner.TargetUnreachable as e:
                print(f"  planner's plan {name}: unreachable ({e})")
                continue
            other = at_pace if prof is as_planned else as_planned
            again = planner.simulate(other, choices, d2h, h2d, prefetch)
            print(f"  planner's plan {name}: {describe(prediction)} (on the other profile: "
                  f"peak {again.peak_bytes / GB:.3f} GB)")


if __name__ == "__main__":
    main()
