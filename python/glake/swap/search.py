"""SmartSwap's search phase: each plan the planner makes is tried for a few steps and measured;
the measurements correct the planner's copy bandwidth and pick the plan that ran fastest, full
recomputation (measured in warm-up) included. Kept free of torch so it can be tested alone."""

import math
import statistics
from dataclasses import dataclass, field

# A plan whose copies made the step wait this share of it longer than predicted is planned
# again with the bandwidth those waits imply.
WAIT_TOLERANCE = 0.01
# A stable step plans again when its waits grew past its trial's by this share of the step:
# where optimizer states cross the link in the backward, waits move by 10 ms from step to step
# (dense-3b on one H200: a trial's 40.2 ms, a stable step's 50.8), and a new plan's first
# steps cost more than that.
DRIFT_TOLERANCE = 0.05
# The planner is told no less than this share of the measured bandwidth: below it the plan
# recomputes everything anyway.
MIN_BANDWIDTH_SCALE = 0.25


@dataclass
class Measurement:
    """One measured step: its device time, the time the consumer stream stood waiting for
    copies in, the host time it took to issue, and the peak reserved and allocated bytes."""
    step_ms: float
    wait_ms: float
    cpu_ms: float
    reserved: int
    allocated: int


@dataclass
class Trial:
    """A plan and the steps measured under it (the first step of a trial is not counted: it
    makes the pinned buffers the plan needs)."""
    summary: dict
    choices: list
    decisions: dict
    prediction: object
    bandwidth_scale: float
    seen: int = 0
    steps: list = field(default_factory=list)
    whole_blocks: bool = False  # a plan of whole blocks kept or recomputed (blocks_to_keep)
    recompute: bool = False  # every block recomputed: warm-up's measurement, measured again

    @property
    def step_ms(self):
        return statistics.median(m.step_ms for m in self.steps) if self.steps else None

    @property
    def peak(self):
        """The highest peak allocated of its measured steps (None before any)."""
        return max(m.allocated for m in self.steps) if self.steps else None

    @property
    def wait_ms(self):
        return statistics.median(m.wait_ms for m in self.steps) if self.steps else None

    def describe(self):
        return {"predicted_step_ms": self.summary["predicted_step_ms"],
                "predicted_wait_ms": self.prediction.exposed_wait_ns / 1e6,
                "swapped_bytes": self.summary["swapped_bytes"],
                "recomputed_bytes": self.summary["recomputed_bytes"],
                "bandwidth_scale": self.bandwidth_scale, "whole_blocks": self.whole_blocks,
                "recompute": self.recompute,
                "measured_step_ms": self.step_ms, "measured_wait_ms": self.wait_ms,
                "cpu_ms": (statistics.median(m.cpu_ms for m in self.steps)
                           if self.steps else None)}


# A trial measures steps until their median is known to within this share of it (one standard
# error), at least the settings' search_steps and at most MAX_TRIAL_STEPS_FACTOR times that.
# Dense models on an H200 step within 1-2% of their median and settle at the least; the
# host-paced MoE benchmark steps 145-221 ms around a median of 177 in one process, where three
# steps leave the median unsure by about a tenth.
MEDIAN_TOLERANCE = 0.03
MAX_TRIAL_STEPS_FACTOR = 3


def median_settled(step_ms, least):
    """Whether the measured steps `step_ms` are enough to take their median as the trial's
    step: at least `least` of them, and either MAX_TRIAL_STEPS_FACTOR * least or a median
    whose standard error (as for a normal spread: 1.2533 standard deviations over the root of
    the count) is within MEDIAN_TOLERANCE of it. The standard deviation, not a deviation from
    the median: with three steps, one far off is what shows the spread."""
    n = len(step_ms)
    if n < least:
        return False
    if n >= MAX_TRIAL_STEPS_FACTOR * least or n < 2:
        return True
    error = 1.2533 * statistics.stdev(step_ms) / math.sqrt(n)
    return error <= MEDIAN_TOLERANCE * statistics.median(step_ms)


def peak_underrating(trials):
    """The most a measured peak among `trials` came over its plan's predicted one (bytes; 0
    when none did, or none was measured): how far the simulation has been seen to underrate
    this workload. The planner's first plan, tried where a measured plan already fits the
    budget, aims this far under it, so a run that has a plan that trains risks less on an
    untried one. Misses the other way do not count: on dense-1b whole-block plans peaked 1.3
    and 1.7 GB under their predictions, and counting them aimed the planner's plan that much
    lower for nothing. (On the MoE benchmark at a 50% cap the planner's plan tried after
    whole-block plans ran out of memory in its first step, 0.57-0.59 GB over its predicted
    peak, aimed 0.42 GiB lower or not: the allocator also left 0.75-1.1 GiB of its cache
    unused there.)"""
    return max([t.peak - t.prediction.peak_bytes for t in trials if t.steps] + [0])


def bandwidth_correction(trial, h2d_bytes_per_s):
    """The factor to scale the planner's bandwidth by after `trial`, or None when its copies
    kept to the prediction. Waits beyond the predicted ones mean the copies in took that much
    longer than planned: the bandwidth that would have made them that long."""
    if not trial.steps or trial.summary["swapped_bytes"] == 0:
        return None
    extra_ms = trial.wait_ms - trial.prediction.exposed_wait_ns / 1e6
    if extra_ms <= WAIT_TOLERANCE * trial.step_ms:
        return None
    copy_ms = trial.summary["swapped_bytes"] / (h2d_bytes_per_s * trial.bandwidth_scale) * 1e3
    return max(MIN_BANDWIDTH_SCALE, min(0.9, copy_ms / (copy_ms + extra_ms)))


# Bounds of the factor the profile's op times are scaled by (see pace_factor).
MIN_PACE, MAX_PACE = 1.0, 1.25


def pace_factor(measured_ms, simulated_ms):
    """The factor that brings the profile's op times to the pace warm-up measured: the ops are
    timed back to back (the device held back before each block), while a real step runs a few
    percent slower (dense models on an H200: warm-up's full recomputation 2-7% slower than the
    profile simulated it, and planned steps 6-13% slower than predicted). Bounded: a profile
    taken while something else held the device reads slow (a factor below 1 is not trusted),
    and a step paced by the host is no faster for faster kernels (one above 1.25 is not
    either). 1 when either figure is missing."""
    if not measured_ms or not simulated_ms:
        return 1.0
    return min(MAX_PACE, max(MIN_PACE, measured_ms / simulated_ms))


# A block whose forward warm-up timed (under PyTorch's checkpoint alone) at less than this share
# of its forward in the profiled step was slowed by the profiling itself: on the host-paced MoE
# benchmark the profiled forwards took 2-5 times warm-up's (each op recorded, the device held
# back, the host syncing on routing); on dense models on an H200 most were within 3% of them
# (in one dense-1b record three blocks of 22 at 0.81-0.86, which moved its plan's predicted
# step by 2 ms of 257 and not its peak).
PROFILE_SLOWED = 0.9


def forward_scales(timed_ns, profiled_ns):
    """Per block, the factor that brings its profiled forward to the one warm-up timed, where
    that is under PROFILE_SLOWED of it, else 1 (a profile is never made slower). A plan's
    swaps leave during the forward: planned against a forward longer than the real one, they
    are predicted gone before they are (on the MoE benchmark a plan simulated at its 6.71 GB
    budget peaked at 10.99 GB when simulated at warm-up's forwards; it ran out of memory at a
    7.07 GB cap)."""
    return [t / p if 0 < t < PROFILE_SLOWED * p else 1.0 for t, p in zip(timed_ns, profiled_ns)]


# Forwards the profiling made this many times slower than warm-up timed them, all blocks
# together, mark a step paced by the host: each op the profile records costs the host more
# than the device. On the MoE benchmark (routing synced on the host) the profiled forwards
# took 2.0-5.5 times warm-up's (one H200, 2026-11-28 and -29); on the dense models 1.0, a few
# blocks of one record at 1.16-1.23. (Taken per block, the median: at 2.1 times in all, the
# median block was under 2, and the planner's plan tried at a 40% cap ran out of memory.)
HOST_PACED_SLOWDOWN = 1.5


def profiling_slowdown(scales, profiled_ns):
    """How many times the profiled forwards (`profiled_ns`, per block) took the ones warm-up
    timed, all blocks together: `scales` (forward_scales) brings each to warm-up's. 1 where
    there is nothing to compare."""
    floored = sum(p * s for p, s in zip(profiled_ns, scales))
    return sum(profiled_ns) / floored if floored > 0 else 1.0


def host_paced(scales, profiled_ns):
    """Whether the profiling slowed the forwards (profiling_slowdown) by HOST_PACED_SLOWDOWN
    or more: a step paced by the host. There the planner's op-level plans are not worth a
    trial once a measured plan fits, whole blocks or full recomputation: their per-op
    dispatch costs more than it saves (blocks_to_keep). On the MoE benchmark on one H200,
    each of the 14 measured in a run that also measured full recomputation (bench/results,
    2026-11-23 to -29) ran slower than it (436 ms against 283, 636 against 398, ...), and with
    the optimizer step in the backward they ran out of memory in their first step each time
    they were tried at a 40% or 50% cap: six trials in five calls, four of them after
    whole-block plans that fit."""
    return profiling_slowdown(scales, profiled_ns) >= HOST_PACED_SLOWDOWN


# A profile whose simulated full recomputation is this much slower than warm-up measured it
# is taken again: warm-up's steps, doing more work, cannot be faster than the profiled one.
# (Undisturbed profiles give 1.02-1.045 on dense models on an H200. In one process, a
# dense-3b profile's backward blocks ran 10.8 ms instead of 7.7: 375 ms for the ops against
# 300 in every other process, and its planner's plan was predicted 386 ms instead of 323.)
DISTURBED_PACE = 0.95


def profile_disturbed(measured_ms, simulated_ms):
    """Whether warm-up's measured full recomputation ran faster than the profile simulates it
    by more than DISTURBED_PACE allows; False when either figure is missing."""
    return bool(measured_ms and simulated_ms) and measured_ms / simulated_ms < DISTURBED_PACE


def memory_correction(correction, allocated, predicted, budget):
    """The goal's new correction after a step that peaked at `allocated` bytes where its plan
    predicted `predicted`, or None when it kept to `budget`. Plans aim at the budget less the
    correction. A step over the budget corrects by what it went over, or by its whole miss
    of the prediction where that is more, so a plan whose peak the profile underrates by a
    fixed amount is corrected once by it, also when the plan came in under its goal (dense-1b
    at 60%: a plan 67 MB under its goal missed its prediction by 142 MB, and adding only what
    it went over, 15 MB a step, gave the same plan three times). Comparing with the lowered
    goal instead corrected again at every plan (dense-3b: three times 0.88 GB, for a miss of
    0.88 GB)."""
    over = allocated - budget
    if over <= 0:
        return None
    # (A plan predicted at or under its goal misses by at least correction + over: the max is
    # then the miss; the first term holds where a plan was predicted over its goal.)
    return max(correction + over, allocated - predicted)


# A whole-block plan whose measured peak left more than this share of the budget unused is
# planned again from its measured peak: each block it can keep more is a forward less
# recomputed (dense-1b in the "memory" preference with the step in the backward: measured
# peaks 1.2-3.0 GB under the predicted ones).
GROW_SLACK = 0.02
# A plan's peak is taken as at most this share of the budget below its prediction.
MAX_OVERRATE = 0.10


def peak_error(measured, predicted, budget):
    """How far a plan's measured peak came from its predicted one (bytes; negative when the
    prediction overrated it), the error the next plan of its kind is aimed with: a plan
    predicted at the budget less this error peaks at the budget. Bounded below at
    MAX_OVERRATE of the budget."""
    return max(measured - predicted, -int(MAX_OVERRATE * budget))


def room_left(trial, budget):
    """Bytes of `budget` the highest measured step of `trial` left unused when they are over
    GROW_SLACK of it, else 0."""
    if not trial.steps:
        return 0
    room = budget - trial.peak
    return room if room > GROW_SLACK * budget else 0


def stable_drift(trial, measurement, h2d_bytes_per_s):
    """The bandwidth factor a stable step asks for: its waits for copies grew past what the
    plan's own trial measured (the link got slower, or other traffic shares it), else None."""
    if trial is None or not trial.steps or trial.summary["swapped_bytes"] == 0:
        return None
    if measurement.wait_ms <= trial.wait_ms + DRIFT_TOLERANCE * measurement.step_ms:
        return None
    later = Trial(trial.summary, trial.choices, trial.decisions, trial.prediction,
                  trial.bandwidth_scale, steps=[measurement])
    return bandwidth_correction(later, h2d_bytes_per_s)


def within_budget(trials, budget):
    """The trials with measured steps whose highest one peaked at most `budget` bytes."""
    return [t for t in trials if t.steps and t.peak <= budget]


def fastest(trials, recompute_ms, budget=None):
    """The trial that ran fastest, or None when full recomputation (measured at `recompute_ms`,
    None if unmeasured) was faster than every trial. With `budget`, a trial whose measured
    steps peaked over it is taken only if every measured one did."""
    measured = [t for t in trials if t.steps]
    measured = (within_budget(trials, budget) if budget else []) or measured
    if not measured:
        return None if recompute_ms is not None else (trials[-1] if trials else None)
    best = min(measured, key=lambda t: t.step_ms)
    if recompute_ms is not None and recompute_ms < best.step_ms:
        return None
    return best


# Bounds of the factor a whole-block plan's timed recomputes are scaled by (saving_scale).
MIN_SAVING_SCALE, MAX_SAVING_SCALE = 0.5, 3.0


def saving_scale(trials, recompute_ms):
    """The factor that brings the step time a whole-block plan is predicted to save (the
    timed recomputes of the blocks it keeps, `timed_saving_ms` in its summary) to what the
    whole-block trials measured it saved: full recomputation's step (`recompute_ms`) less
    theirs, summed over them. The device times each recompute, but a step paced by the host
    also waits for the host to issue it: on the MoE benchmark on one H200 the blocks kept
    saved 1.0-3.5 times their timed recomputes (whole-block plans predicted up to 46% slow).
    Bounded to [MIN_SAVING_SCALE, MAX_SAVING_SCALE]; 1 before any whole-block trial."""
    if recompute_ms is None:
        return 1.0
    pairs = [(recompute_ms - t.step_ms, t.summary["timed_saving_ms"]) for t in trials
             if t.whole_blocks and t.steps and t.summary.get("timed_saving_ms")]
    if not pairs:
        return 1.0
    ratio = sum(m for m, _ in pairs) / sum(s for _, s in pairs)
    return min(MAX_SAVING_SCALE, max(MIN_SAVING_SCALE, ratio))


def worth_trying(predicted_ms, trials, recompute_ms):
    """Whether a plan not yet tried, its step predicted at `predicted_ms`, is worth a trial:
    that is shorter than every measured step (each trial's, and full recomputation's at
    `recompute_ms`)."""
    measured = [t.step_ms for t in trials if t.steps]
    if recompute_ms is not None:
        measured.append(recompute_ms)
    return predicted_ms < min(measured, default=float("inf"))


def blocks_to_keep(saving_ms, block_bytes, fits):
    """The blocks a whole-block plan runs as written, every other block recomputed by PyTorch's
    checkpoint with no dispatch mode: where the step is paced by the host (a model that syncs
    on data-dependent routing), an op-level plan's per-op dispatch costs more than it saves,
    and keeping whole blocks is what beats full recomputation. Blocks are taken by step time
    saved (`saving_ms`: each block's recompute, which running it as written spares) per byte
    it keeps (`block_bytes`), each one added while `fits(kept)` says the plan's peak stays
    under the goal. Returns the kept blocks in order."""
    order = sorted(range(len(saving_ms)),
                   key=lambda b: (-saving_ms[b] / max(block_bytes[b], 1), b))
    kept = []
    for b in order:
        if saving_ms[b] > 0 and fits(sorted(kept + [b])):
            kept.append(b)
    return sorted(kept)
