"""SmartSwap for PyTorch: train in less device memory than the step needs, by keeping, swapping
to host memory or recomputing what each transformer block saves for its backward, as glake's
planner decides from a profiled step.

    import glake.swap
    smart = glake.swap.apply(model, target=0.6)   # a fraction of the device's memory, or bytes
    # ... the training loop, unchanged ...
    print(smart.report())

or `glake.torch.enable(swap={"target": 0.6})` (the first model run with gradients is planned),
or GLAKE_SWAP_TARGET=0.6 in the environment of a program that calls glake.torch.enable().

Phases, as in SmartSwap: warm-up (four steps with every block recomputed by PyTorch's own
checkpoint, all but the first timed, then one profiled: each op's device time from events and
output bytes, each block's forward and backward time, memory at the block boundaries), search
(glake_swap_plan picks keep, swap or recompute for each heavy op output (matmuls, attention)
and for each block's cheap outputs, to meet the target at the best predicted step; each plan
is tried for a few steps: a step over the goal plans again for less, copies slower than
predicted plan again with the bandwidth they showed, and the fastest plan measured, or full
recomputation if it was faster, is kept; where a plan of whole blocks kept or recomputed
exists, full recomputation is timed again first and that plan goes next; full recomputation
that warm-up found faster is measured again as a trial before it is kept), stable (every 20th
step is measured; one that waits for copies longer than its plan's trial did plans again at
the bandwidth it showed and searches from there). New input shapes send it back to warm-up,
with a log line saying so.

The blocks are the entries of the model's largest ModuleList of one class (the transformer
layers). A block whose plan keeps everything runs as written; the others run under
torch.utils.checkpoint with glake's dispatch modes (glake.swap.executor), which keep what the
plan keeps, copy what it swaps to pinned host memory on a side stream (brought back a block
ahead of the backward) and recompute the rest. Losses and gradients are those of the unplanned
step."""

import contextlib
import dataclasses
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from . import planner
from .executor import KEEP, SWAP, RecordingMode, ReplayMode, Swapper, TimedContext, Timer
from .profiling import Marks, ProfilingMixin
from .search import (Measurement, Trial, bandwidth_correction, blocks_to_keep, fastest,
                     host_paced, median_settled, memory_correction, pace_factor, peak_underrating,
                     peak_error, profile_disturbed, profiling_slowdown, room_left, saving_scale,
                     stable_drift, within_budget, worth_trying)
from .states import OptimizerStatesMixin, StateSwapper, state_tensors

log = logging.getLogger("glake.swap")
_STABLE_EVERY = 20  # stable steps between two measured ones (measuring waits for the GPU)
_WARMUP_STEPS = 4  # before the profiled step: the first pays one-time costs (optimizer
# states, library handles, the allocator's first growth) that would inflate the profile; the
# others are measured as full recomputation (their median: on the host-paced MoE benchmark
# one such step read 238-455 ms where the steps after it ran 245-390)
_WARMUP_UNMEASURED = 1
_MAX_CORRECTIONS = 3  # re-plans a search may ask for before it keeps the plan it has
_PROFILE_MISS = 0.25  # a first plan measured this far off its prediction is profiled again
_MAX_TRIALS = 3  # plans a search tries (each corrected by the last one's measured waits)
_ENV = {"target": "GLAKE_SWAP_TARGET", "preference": "GLAKE_SWAP_PREFERENCE",
        "swap_bucket_size": "GLAKE_SWAP_BUCKET_SIZE", "prefetch": "GLAKE_SWAP_PREFETCH",
        "margin": "GLAKE_SWAP_MARGIN", "states_in_step": "GLAKE_SWAP_STATES_IN_STEP",
        "step_in_backward": "GLAKE_SWAP_STEP_IN_BACKWARD"}


@dataclass
class Settings:
    """What SmartSwap aims for. `target`: peak device memory, as bytes (> 1) or a fraction of
    the device (<= 1); None: the per-process memory fraction set in torch, else no target
    (nothing is moved). `preference`: "performance" (activations only) or "memory" (the planner
    may also move optimizer states and gradients; on PyTorch the executor moves activations
    only, so both plan the same here). `swap_bucket_size`: cheap outputs of a block are
    planned in buckets of at least this many bytes (0: one bucket per block). `prefetch`:
    blocks ahead that swap-ins start. `margin`: share of the target left for what the profile
    cannot see (allocator rounding, the copy engine's buffers). `search_steps`: the least
    measured steps per plan tried in the search (more, up to three times as many, while the
    steps leave their median unsure by more than 3%: search.median_settled).
    `states_in_step` (the "memory" preference): optimizer states
    come back only in the block-by-block optimizer step, never all at once (None: when the
    parameters, gradients and states would not fit the target together). `step_in_backward`
    (the "memory" preference): each block's part of the optimizer step runs in the backward
    as soon as the block's gradients are complete, its states brought back just for it and
    its gradients freed after it, so the states' copies overlap the backward and the model's
    gradients are never all on the device; it turns itself on after a first step showing that
    nothing changes the gradients between backward and step (it cannot see code that only
    reads them: gradients of the blocks are None after the backward)."""
    target: float = None
    preference: str = "performance"
    swap_bucket_size: int = 0
    prefetch: int = 1
    margin: float = 0.05
    search_steps: int = 3
    states_in_step: bool = None
    step_in_backward: bool = False

    @classmethod
    def from_env(cls, **overrides):
        values = {}
        for key, var in _ENV.items():
            raw = os.environ.get(var)
            if raw:
                values[key] = (raw if key == "preference" else
                               _parse_size(raw, var) if key == "target" else float(raw))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown SmartSwap setting(s): {sorted(unknown)}")
        for key in ("swap_bucket_size", "prefetch", "search_steps"):
            if key in values:
                values[key] = int(values[key])
        for key in ("states_in_step", "step_in_backward"):
            if values.get(key) is not None:
                values[key] = bool(values[key])
        s = cls(**values)
        if s.preference not in planner.PREFERENCES:
            raise ValueError(f"preference must be one of {sorted(planner.PREFERENCES)}")
        if s.prefetch < 1 or s.search_steps < 1 or not 0 <= s.margin < 0.5:
            raise ValueError(f"bad SmartSwap settings: {s}")
        return s


def _parse_size(raw, name):
    """A fraction (at most 1) or bytes, with an optional K, M, G or T suffix (powers of 1024),
    as the native side reads GLAKE_SWAP_TARGET."""
    text = raw.strip().upper().removesuffix("B")
    scale = 1
    if text and text[-1] in "KMGT":
        scale = 1024 ** ("KMGT".index(text[-1]) + 1)
        text = text[:-1]
    try:
        return float(text) * scale
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a fraction or a byte count") from None


def find_blocks(model):
    """The model's repeated blocks: of the torch.nn.ModuleLists whose entries share a class, the
    one holding the most parameters (the layers, not the experts inside each layer)."""
    best, best_size = None, -1
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            if len({type(m) for m in module}) == 1:
                size = sum(p.numel() for p in module.parameters())
                if size > best_size:
                    best, best_size = module, size
    if best is None:
        raise ValueError("glake.swap: the model has no ModuleList of repeated blocks")
    return list(best)


def _first_grad_tensor(tree):
    for t in torch.utils._pytree.tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _shapes(args, kwargs):
    flat = torch.utils._pytree.tree_flatten((args, kwargs))[0]
    return tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))


class SmartSwap(ProfilingMixin, OptimizerStatesMixin):
    """Plans and runs the blocks of one model; see the module's documentation. Profiling lives
    in profiling.py, the optimizer's side in states.py."""

    def __init__(self, blocks, settings=None, device=None, optimizer=None):
        self.blocks = list(blocks)
        self.settings = settings or Settings.from_env()
        p = next(self.blocks[0].parameters(), None)
        self.device = torch.device(device) if device else (p.device if p is not None
                                                           else torch.device("cuda"))
        self.cuda = self.device.type == "cuda"
        self.swapper = Swapper(self.device)
        self.states = StateSwapper(self.swapper)
        self.optimizer = None       # the optimizer stepping the blocks' parameters, once seen
        self.state_release = {}     # block -> block before whose forward its states are freed
        self._splitting = False     # inside the block-by-block optimizer step
        self.in_optimizer_step = False  # between the optimizer's pre- and post-step hooks
        self._unwrap_optimizer = None
        self._hook_optimizers(optimizer)
        self.phase = "warmup"
        self.iteration = 0
        self.signature = None
        self.decisions = None       # block -> {op index: KEEP | SWAP}; absent: plain
        self.expected = {}          # block -> [func] of the profiled forward
        self.marks = None
        self.profile = None
        self.prediction = None
        self.choices = None         # the planner's (action, out_after, in_before) per tensor
        self.meaning = None         # per planner tensor: (block, op indexes), or None if fixed
        self.target_bytes = None
        self.correction = 0         # the planner's plans aim this far under the budget
        self.whole_error = 0        # whole-block plans' measured peak less predicted peak
        self.overshot = []          # choices of whole-block plans whose step went over the budget
        self.untried_margin = 0     # bytes the planner's untried plan aims under the budget
        self.corrections = 0
        self.bandwidth = None
        self.measured = []          # search.Measurement of stable steps
        self.trials = []            # search.Trial per plan tried in this search
        self.deferred = None        # the planner's trial, waiting on a faster-predicted one
        self.opening_recompute = False  # the trial under way measures full recomputation first
        self.bandwidth_scale = 1.0  # share of the measured bandwidth the planner is told
        self.recompute_ms = None    # step with every block recomputed (median of warm-up's)
        self.pace = 1.0             # profile times scaled by it (_pace_profile)
        self.warm_recompute_ms = None  # warm-up's own measurement of that step
        self.block_fwd_ms = None    # each block's forward there
        self.warm_block_fwd_ms = None  # warm-up's (the search's opening trial times them again)
        self.block_recompute_ms = None  # each block's recompute in that step's backward
        self.forward_scales = []    # per block, what the profiled forward is brought down by
        self.profiled_fwd_ns = []   # per block, the profiled forward as timed
        self._warm_steps = []       # warm-up's measured steps, ms
        self._block_timers = {}     # block -> [Timer] of its forwards in those steps
        self._recompute_timers = {}  # block -> [Timer] of its recomputes in their backwards
        self.warm_peak = None       # peak allocated bytes over warm-up (CUDA)
        self.resident_states = []   # step mode: blocks whose states stay on the device
        self.reprofiled = False     # profiled again since the last warm-up
        self.chosen = None          # the trial whose plan runs in stable (None: recomputing)
        self.step_start = None
        self.step_cpu = None
        self.history = []
        self.enabled = True
        for b, block in enumerate(self.blocks):
            block.forward = self._wrap(b, block.forward)

    def remove(self):
        """Gives every block its own forward back, and the optimizer its states."""
        for block in self.blocks:
            vars(block).pop("forward", None)
        self.states.restore()
        self._unhook_optimizers()
        self.enabled = False

    # -- phases ---------------------------------------------------------------------------

    def _resolve_target(self):
        t = self.settings.target
        if t is None and self.cuda:
            try:
                fraction = torch.cuda.get_per_process_memory_fraction(self.device)
            except (AttributeError, RuntimeError):
                fraction = 1.0
            t = fraction if fraction < 1.0 else None
        if t is None:
            return None
        if t <= 1.0:
            total = (torch.cuda.mem_get_info(self.device)[1] if self.cuda else 0)
            return int(t * total)
        return int(t)

    def _begin_iteration(self, args, kwargs):
        self._new_backward_step_iteration()
        if self._restart_pending:
            self._restart_pending = False
            log.warning("glake.swap: back to warm-up: the plan counted on the optimizer step "
                        "in the backward")
            self._restart()
        sig = _shapes(args, kwargs)
        if self.signature is not None and sig != self.signature:
            log.warning("glake.swap: block input shapes changed from %s to %s: back to warm-up",
                        self.signature, sig)
            self._restart()
        self.signature = sig
        now = self._event()
        if self.step_start is not None and (
                self.phase == "search"
                or (self.phase == "warmup" and self._warm_measured(self.iteration))
                or (self.phase == "stable" and self.iteration % _STABLE_EVERY == 0)):
            self._measure(now)
        if self.phase == "profile" and self.marks is not None:
            self.marks.next_start = now
            self.marks.tail_peak = self._memory()[1]  # since the backward's end
            self._plan()
        elif self.phase == "warmup" and self.iteration >= _WARMUP_STEPS:
            self.phase = "profile"
            self.marks = Marks()
            if self.cuda:
                self.warm_peak = torch.cuda.max_memory_allocated(self.device)
        elif self.phase == "warmup" and self.iteration == 0 and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # warm-up's own peak, for states
        self.iteration += 1
        self.step_start, self.step_cpu = now, time.perf_counter()
        # (The profiled step times its waits too: each block's are taken out of its backward.)
        measured = self.phase in ("search", "profile") or (
            self.phase == "stable" and self.iteration % _STABLE_EVERY == 0)
        self.swapper.waits = [] if (measured and self.cuda) else None
        if self.cuda and self.phase in ("search", "stable", "profile"):
            torch.cuda.reset_peak_memory_stats(self.device)

    def _times_blocks(self):
        """Whether this step times each block's forward and recompute: warm-up's measured
        steps, and the steps of the search's opening trial of full recomputation (see
        _whole_blocks_first)."""
        if self.phase == "warmup":
            return self._warm_measured(self.iteration)
        return (self.phase == "search" and self.opening_recompute and bool(self.trials)
                and self.trials[-1].recompute)

    def _take_block_timings(self):
        """Each block's forward and recompute time, the median of the steps timed since the
        last call (kept as they were when some block has none)."""
        forwards, self._block_timers = self._block_timers, {}
        recomputes, self._recompute_timers = self._recompute_timers, {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
        blocks = range(len(self.blocks))
        if all(forwards.get(b) for b in blocks):
            self.block_fwd_ms = [statistics.median(t.ns() / 1e6 for t in forwards[b])
                                 for b in blocks]
        if all(recomputes.get(b) for b in blocks):
            self.block_recompute_ms = [statistics.median(t.ns() / 1e6 for t in recomputes[b])
                                       for b in blocks]

    @staticmethod
    def _warm_measured(step):
        """Whether warm-up's step number `step` (from 1) is measured as full recomputation."""
        return _WARMUP_UNMEASURED < step <= _WARMUP_STEPS

    def _reprofile(self):
        """Back to the profiled step, once per warm-up: the profile was taken while something
        else held the device or the link. From a measured step, the next step is profiled;
        from _plan (at the start of a step), that step runs as warm-up and the one after it is
        profiled."""
        self._forget_search()
        self.reprofiled, self.bandwidth = True, None

    def _restart(self):
        self._forget_search()
        self.iteration, self.reprofiled = 0, False
        self.marks, self.expected, self.measured = None, {}, []
        self.recompute_ms = self.warm_recompute_ms = None
        self.block_fwd_ms, self.block_recompute_ms, self.warm_block_fwd_ms = None, None, None
        self._block_timers, self._recompute_timers, self._warm_steps = {}, {}, []
        self.swapper.forget()

    def _forget_search(self):
        """Back to warm-up with nothing the search learned from the profile or shapes left
        behind: no plan, no trials, no corrections, the bandwidth scale at 1; states move as
        in warm-up."""
        self.phase, self.decisions = "warmup", None
        self._stop_moving_states()
        self.trials, self.chosen, self.deferred = [], None, None
        self.opening_recompute = False
        self.correction, self.corrections = 0, 0
        self.whole_error, self.overshot = 0, []
        self.untried_margin = 0
        self.bandwidth_scale = 1.0

    # -- the wrapped forward ----------------------------------------------------------------

    def _wrap(self, b, original):
        def forward(*args, **kwargs):
            if not (self.enabled and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            if b == 0:
                self._begin_iteration(args, kwargs)
            return self._run_block(b, original, args, kwargs)
        return forward

    def _run_block(self, b, original, args, kwargs):
        profiling = self.phase == "profile" and self.marks is not None
        self.swapper.release(b)
        if self.states.in_step:
            if b == 0:
                # No state is needed before the next step: whatever went out (a whole step's,
                # a checkpoint's, states made before adoption) is freed before the first block.
                self.states.release(list(self.states.out))
        elif self.state_release:
            self.states.release([g for g, r in self.state_release.items() if r <= b])
        if profiling:
            alloc, _ = self._memory()
            self.marks.alloc_before[b] = alloc
            self._head_start()
            start = self._event()
            issued = time.perf_counter()
            if b == 0:
                first = _first_grad_tensor((args, kwargs))
                if first is not None:
                    first.register_hook(lambda g: self._on_backward_end())
        decisions = None
        if self.phase in ("warmup", "profile"):
            decisions = {}
        elif self.decisions is not None and b in self.decisions:
            decisions = self.decisions[b]
        timer = Timer(self.cuda) if self._times_blocks() else None
        if decisions is None:
            out = original(*args, **kwargs)
        elif not decisions and not profiling:
            # Nothing kept or swapped: PyTorch's own checkpoint, with no dispatch mode to pay
            # (its recompute in the backward timed where the forward is).
            if timer is None:
                out = checkpoint(original, *args, use_reentrant=False, **kwargs)
            else:
                recomputes = self._recompute_timers.setdefault(b, [])
                out = checkpoint(original, *args, use_reentrant=False,
                                 context_fn=lambda: (contextlib.nullcontext(),
                                                     TimedContext(self.cuda, recomputes)),
                                 **kwargs)
        else:
            cache = {}
            records = [] if profiling else None
            if profiling:
                self.marks.records[b] = records
            expected = self.expected.get(b)

            def contexts():
                replay = (ReplayMode(cache, self.swapper) if decisions
                          else contextlib.nullcontext())
                return (RecordingMode(b, decisions, cache, self.swapper, expected, records),
                        replay)
            out = checkpoint(original, *args, use_reentrant=False, context_fn=contexts,
                             **kwargs)
        if timer is not None:
            timer.stop()
            self._block_timers.setdefault(b, []).append(timer)
        if profiling:
            self.marks.fwd[b] = (start, self._event())
            self.marks.issue_ms = (time.perf_counter() - issued) * 1e3
            self.marks.alloc_after[b] = self._memory()[0]
            if b == len(self.blocks) - 1 and self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
        grad_out = _first_grad_tensor(out)
        if grad_out is not None:
            grad_out.register_hook(lambda g: self._on_backward(b))
        if b == len(self.blocks) - 1:
            self.swapper.release()
            self.states.release(list(self.state_release))
            self.swapper.prefetch(b)
        return out

    def _on_backward(self, b):
        """The backward of block `b` starts: bring back what the next blocks swapped out."""
        for ahead in range(b, max(-1, b - self.settings.prefetch - 1), -1):
            self.swapper.prefetch(ahead)
            self.states.backward_prefetch(ahead, self.backward_step == "on")
        if self.phase == "profile" and self.marks is not None:
            alloc, peak = self._memory()
            self.marks.bwd[b] = (self._event(), alloc, peak)
            self.marks.waits_before[b] = len(self.swapper.waits or ())
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)

    # -- profile -> plan ----------------------------------------------------------------------

    def _plan(self):
        self.expected = {b: [r.func for r in recs] for b, recs in self.marks.records.items()}
        if self.bandwidth is None:
            self.bandwidth = self._measure_bandwidth()
        self._take_block_timings()
        self.warm_block_fwd_ms = self.block_fwd_ms
        self.profile, self.meaning = self._build_profile()
        simulated_ms = self._pace_profile()
        self.marks = None
        if profile_disturbed(self.recompute_ms, simulated_ms) and not self.reprofiled:
            log.warning("glake.swap: warm-up's steps ran %.2f times the profiled pace, faster "
                        "with more work: profiling again", self.recompute_ms / simulated_ms)
            self._reprofile()
            return
        self._floor_forwards()
        self.target_bytes = self._resolve_target()
        self._replan()
        self._whole_blocks_first()
        self.phase = "search"

    def _pace_profile(self):
        """Scales the profile's op and recompute times to the pace of warm-up's measured steps
        (search.pace_factor), so that every prediction, and the balance of copies against
        compute the planner weighs, is at the step's real pace. Returns the profile's
        simulated full recomputation in ms before scaling (None without warm-up's)."""
        self.pace = 1.0
        if self.recompute_ms is None:
            return None
        full = planner.simulate(self.profile, self._full_recompute_choices(), *self.bandwidth,
                                self.settings.prefetch + 1)
        simulated_ms = full.step_ns / 1e6
        self.pace = pace_factor(self.recompute_ms, simulated_ms)
        if self.pace != 1.0:
            log.info("glake.swap: warm-up's steps ran %.2f times the profiled pace: the "
                     "profile's times are scaled by it", self.pace)
            k, p = self.pace, self.profile
            p.ops = [(int(ns * k), phase) for ns, phase in p.ops]
            p.tensors = [dataclasses.replace(t, recompute_ns=int(t.recompute_ns * k))
                         if t.recompute_ns is not None else t for t in p.tensors]
        return simulated_ms

    def _replan(self, replace=False):
        """Plans for the goal with the bandwidth as corrected so far, and starts trying the
        plan (`replace`: instead of the trial under way, whose step overshot the goal)."""
        profile, s = self.profile, self.settings
        d2h, h2d = (x * self.bandwidth_scale for x in self.bandwidth)
        target = self.target_bytes
        if target is None:
            choices = [(planner.KEEP, 0, 0)] * len(profile.tensors)
            self.prediction = planner.simulate(profile, choices, d2h, h2d, s.prefetch + 1)
        else:
            goal = self._goal()
            try:
                choices, self.prediction = planner.plan(profile, goal, d2h, h2d, s.prefetch + 1,
                                                        s.preference)
            except planner.TargetUnreachable as e:
                log.warning("glake.swap: %s; recomputing every block in full", e)
                choices = self._full_recompute_choices()
                self.prediction = planner.simulate(profile, choices, d2h, h2d, s.prefetch + 1)
        self._adopt(choices, self.bandwidth_scale)
        self.history.append(self._summary())
        log.info("glake.swap: plan %s", self.history[-1])
        if replace and self.trials:
            self.trials.pop()
        self.trials.append(Trial(self.history[-1], self.choices, self.decisions,
                                 self.prediction, self.bandwidth_scale))

    def _adopt(self, choices, bandwidth_scale):
        """Makes `choices` the plan the executor follows from the next block on."""
        self.choices = choices
        self.decisions = self._decisions(choices)
        carried = self.backward_step == "on"  # the plan chose which states stay
        # In step mode every block's states move, but those that fit (below).
        groups = self._state_groups() if self.states.in_step and not carried else {}
        kept = []
        for (action, _, _), meaning in zip(choices, self.meaning):
            if meaning is not None and meaning[0] == "state":
                b = meaning[1]
                if action == planner.SWAP:
                    groups[b] = state_tensors(self.optimizer, self.blocks[b].parameters())
                else:
                    kept.append(b)
        if not carried:
            groups = self._keep_states_that_fit(groups)
        else:
            self.resident_states = kept
        # Adopted before a step's first block: what the plan moves leaves during that step,
        # unless the forward runs inside the optimizer step (a closure), which needs them.
        self.states.plan(groups, leave_now=not self.in_optimizer_step)
        if self.resident_states and not carried:
            self.prediction = self._with_states_kept(choices, bandwidth_scale)
        self.swapper.release_at, self.state_release = self._release_schedule(
            choices, bandwidth_scale)

    def _state_bytes(self, blocks):
        return sum(self.states.full_bytes(state_tensors(self.optimizer,
                                                        self.blocks[b].parameters()))
                   for b in blocks)

    def _state_copy_ns(self, blocks, bandwidth_scale):
        """How long the step spends copying the states of `blocks` (in and out at once, so as
        long as the slower direction)."""
        return self._state_bytes(blocks) * 1e9 / (min(self.bandwidth) * bandwidth_scale)

    def _with_states_kept(self, choices, bandwidth_scale):
        """The prediction of `choices` once step mode keeps some blocks' states: the profiled
        optimizer step held the copies of every block's states, and those kept are copied no
        more."""
        d2h, h2d = (x * bandwidth_scale for x in self.bandwidth)
        ops = list(self.profile.ops)
        ns, phase = ops[-1]
        ops[-1] = (max(0, int(ns - self._state_copy_ns(self.resident_states, bandwidth_scale))),
                   phase)
        profile = planner.Profile(ops=ops, tensors=self.profile.tensors,
                                  base_bytes=self.profile.base_bytes)
        prediction = planner.simulate(profile, choices, d2h, h2d, self.settings.prefetch + 1)
        # The profile saw every state off the device; the kept ones stay on it throughout.
        kept = self._state_bytes(self.resident_states)
        return dataclasses.replace(prediction, peak_bytes=prediction.peak_bytes + kept,
                                   baseline_peak_bytes=prediction.baseline_peak_bytes + kept)

    def _release_schedule(self, choices, bandwidth_scale):
        """Where the executor frees what goes out: per block, the first later block whose
        forward starts after the copy queue has moved it, at the profiled forward times and
        the planned bandwidth; optimizer states first (their copies start at the optimizer
        step), then each block's swapped outputs. Returns ({block: release block} for
        outputs, the same for optimizer states), so the step neither waits for a copy nor
        holds memory much longer than the plan counts on."""
        n = len(self.blocks)
        fwd = [self.profile.ops[b][0] for b in range(n)]
        starts = [sum(fwd[:b]) for b in range(n)]
        swapped, states = [0] * n, {}
        for (action, _, _), t, meaning in zip(choices, self.profile.tensors, self.meaning):
            if meaning is None or action != planner.SWAP:
                continue
            if meaning[0] == "state":
                if self.backward_step != "on":  # else they leave in the backward
                    states[meaning[1]] = t.bytes
            else:
                swapped[meaning[0]] += t.bytes
        ns_per_byte = 1e9 / (self.bandwidth[0] * bandwidth_scale)

        def first_after(b, t):
            return next((r for r in range(b, n) if starts[r] >= t), n)

        queue_end, state_release = 0, {}
        for b in sorted(states):
            queue_end += states[b] * ns_per_byte
            state_release[b] = first_after(1, queue_end)
        schedule = {}
        for b in range(n):
            if swapped[b]:
                queue_end = max(queue_end, starts[b] + fwd[b]) + swapped[b] * ns_per_byte
                schedule[b] = first_after(b + 1, queue_end)
        return schedule, state_release

    def _whole_blocks_first(self):
        """Where a whole-block plan exists, opens the search with a trial of full
        recomputation, the planner's plan waiting (`deferred`); _after_opening_trial goes on
        from its measurement. The whole-block plan is predicted from full recomputation's step
        and each block's recompute: timed again in the search's conditions (after the profiled
        step, on the allocator's layout of then). On the host-paced MoE benchmark that
        measurement and warm-up's differed by up to 40%, either way; warm-up's figure had put
        the planner's plan first at a 50% cap, and it ran out of memory there. A plan's first
        step is where the allocator meets its layout, and full recomputation is the plan
        least likely not to fit there: warm-up ran it. Where the host paces the step
        (search.host_paced) the search opens so even with no whole-block plan: the planner's
        plan then runs only if full recomputation does not fit (_resume_deferred)."""
        per_op = self.trials[-1] if self.trials else None
        if per_op is None or self.target_bytes is None:
            return  # (no target: nothing is moved, nothing to weigh)
        if self._whole_block_plan() is None and not self._host_paced():
            return
        self.deferred = per_op
        self.trials.pop()
        self.opening_recompute = True
        self._start_recompute_trial()

    def _after_opening_trial(self, trial):
        """After full recomputation measured at the search's start (_whole_blocks_first):
        its step and block timings replace warm-up's, and its measured peak against the
        simulated one aims whole-block plans (it is the plan of whole blocks that keeps none).
        The whole-block plan made from them is tried next if it is predicted faster than every
        step measured (search.worth_trying); the planner's (deferred) plan follows it, or
        comes instead, on the same condition. Whole blocks go first even when the planner's
        plan is predicted faster: on the MoE benchmark the planner's plans under 40-50% caps
        ran out of memory in their first step (peaks at least 0.41 and 0.59 GB over the
        prediction) in two calls out of two, where a whole-block plan at the same caps
        trained. True when a trial started."""
        self.opening_recompute = False
        if trial.steps:
            self.recompute_ms = trial.step_ms
            if self.target_bytes is not None:
                self.whole_error = peak_error(trial.peak, trial.prediction.peak_bytes,
                                              self._budget())
        self._take_block_timings()
        whole = self._whole_block_plan()
        if whole is not None and worth_trying(whole[2].step_ns / 1e6, self.trials,
                                              self.recompute_ms):
            log.info("glake.swap: full recomputation measured %.1f ms: the whole-block plan "
                     "is tried (predicted %.1f ms)", self.recompute_ms, whole[2].step_ns / 1e6)
            self._start_whole_blocks(*whole)
            return True
        return self._resume_deferred()

    def _host_paced(self):
        """Whether the profiling showed a step paced by the host (search.host_paced)."""
        return host_paced(self.forward_scales, self.profiled_fwd_ns)

    def _resume_deferred(self):
        """Tries the planner's deferred plan (planned again: the goal or the bandwidth may
        have been corrected since) if it is still worth a trial, before and after planning
        it again; never where the host paces the step and a measured plan (whole blocks, or
        full recomputation) fits (search.host_paced). Where a measured plan fits the budget,
        its first plan aims under the budget by the simulation's underrating so far
        (search.peak_underrating). True when it started."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return False
        if not worth_trying(deferred.prediction.step_ns / 1e6, self.trials, self.recompute_ms):
            log.info("glake.swap: the planner's plan (predicted %.1f ms) is not tried: a "
                     "measured step is as fast", deferred.prediction.step_ns / 1e6)
            return False
        fitting = (within_budget(self.trials, self._budget())
                   if self.target_bytes is not None else [])
        if fitting and self._host_paced():
            log.info("glake.swap: the planner's plan (predicted %.1f ms) is not tried: the step "
                     "is paced by the host (the profiled forwards took %.1f times warm-up's) "
                     "and a measured plan fits", deferred.prediction.step_ns / 1e6,
                     profiling_slowdown(self.forward_scales, self.profiled_fwd_ns))
            return False
        if fitting and self._planner_trials() == 0:
            self.untried_margin = peak_underrating(self.trials)
            log.info("glake.swap: a measured plan fits the budget: the planner's plan aims "
                     "%.2f GiB under it (the most a measured peak came over its prediction)",
                     self.untried_margin / 2**30)
        self._replan()
        if not worth_trying(self.prediction.step_ns / 1e6, self.trials[:-1], self.recompute_ms):
            log.info("glake.swap: the planner's plan for that goal (predicted %.1f ms) is not "
                     "tried: a measured step is as fast", self.prediction.step_ns / 1e6)
            self.trials.pop()
            return False
        return True

    def _block_savings_ms(self):
        """What running each block as written saves against recomputing it: its recompute in
        the backward as timed, else (not timed) its forward."""
        return self.block_recompute_ms or self.block_fwd_ms

    def _whole_block_plan(self):
        """The whole-block plan (search.blocks_to_keep) for the goal, as (kept blocks, choices,
        prediction): its step predicted from full recomputation's measured step less the
        recomputes it skips (plus the copy waits the simulation adds to full recomputation's),
        its peak by the planner's simulation; with carried states, the number of them kept on
        the device that predicts the fastest step. None when there is nothing to try: no goal
        or timing of full recomputation, no block fits, or a trial had the plan."""
        goal = self._goal(whole_blocks=True)
        savings = self._block_savings_ms()
        if goal is None or self.recompute_ms is None or savings is None:
            return None
        base = self._full_recompute_choices()
        d2h, h2d = self.bandwidth
        block_bytes = [0] * len(self.blocks)
        for t, meaning in zip(self.profile.tensors, self.meaning):
            if meaning is not None and meaning[0] != "state":
                block_bytes[meaning[0]] += t.bytes

        def keeping(kept, resident=()):
            """Full recomputation but the blocks `kept` as written and the carried states of
            `resident` kept on the device throughout."""
            kept = set(kept)
            return [(planner.KEEP, 0, 0) if m is not None and (
                m[1] in resident if m[0] == "state" else m[0] in kept) else c
                for c, m in zip(base, self.meaning)]

        def simulate(kept, resident=()):
            return planner.simulate(self.profile, keeping(kept, resident), d2h, h2d,
                                    self.settings.prefetch + 1)

        def best_for(resident):
            """(predicted ms, kept blocks, choices, simulation, timed saving ms) with
            `resident` kept."""
            kept = blocks_to_keep(savings, block_bytes,
                                  lambda k: simulate(k, resident).peak_bytes <= goal)
            if not kept:
                return None
            run = simulate(kept, resident)
            # Warm-up measured every block recomputed, its copies included; a plan that
            # recomputes less leaves the copies less time to hide in, one that keeps states
            # copies less (the simulation's waits against full recomputation's).
            extra = (run.exposed_wait_ns - full.exposed_wait_ns) / 1e6
            timed = sum(savings[b] for b in kept)
            ms = self.recompute_ms - scale * timed + extra
            return ms, kept, keeping(kept, resident), run, timed

        # What earlier whole-block trials measured their kept blocks to save.
        scale = saving_scale(self.trials, self.recompute_ms)

        full = simulate(())
        carried = sorted((m[1] for m, t in zip(self.meaning, self.profile.tensors)
                          if m is not None and m[0] == "state"
                          and t.kind == planner.CARRIED_STATE), reverse=True)
        # Carried states kept on the device take memory from kept blocks but save their
        # copies: each count of them is weighed, as the first needed in the backward (the
        # link starts later) and spread evenly over it (the link rests between the copies).
        best = None
        for n in range(len(carried) + 1):
            found = [best_for(resident) for resident in _resident_choices(carried, n)]
            found = [f for f in found if f is not None]
            if not found:
                break  # no block fits beside that many states: more only take more memory
            fastest_found = min(found, key=lambda f: f[0])
            if best is None or fastest_found[0] < best[0]:
                best = fastest_found
        if best is None:
            return None
        ms, kept, choices, run, timed = best
        if any(t.choices == choices for t in self.trials) or choices in self.overshot:
            return None
        return kept, choices, dataclasses.replace(run, step_ns=int(ms * 1e6)), timed

    def _grow_whole_blocks(self, trial):
        """After a whole-block trial whose measured peak left room under the budget
        (search.room_left): plans whole blocks again, aimed by that trial's measured peak
        error, and tries the plan when it differs from every plan tried and is predicted
        faster than every step measured. True when it started."""
        if self.target_bytes is None or sum(t.whole_blocks for t in self.trials) >= _MAX_TRIALS:
            return False
        budget = self._budget()
        room = room_left(trial, budget)
        if not room:
            return False
        self.whole_error = peak_error(trial.peak, trial.prediction.peak_bytes, budget)
        plan = self._whole_block_plan()
        if plan is None or not worth_trying(plan[2].step_ns / 1e6, self.trials,
                                            self.recompute_ms):
            return False
        log.info("glake.swap: the whole-block plan left %.2f GiB of the budget unused (its "
                 "peak measured %.2f GiB from the predicted): planning whole blocks again",
                 room / 2**30, self.whole_error / 2**30)
        self._start_whole_blocks(*plan)
        return True

    def _start_whole_blocks(self, kept, choices, prediction, timed_saving_ms, replace=False):
        """Starts the trial of a whole-block plan, in place of the trial under way with
        `replace`; `timed_saving_ms` is the kept blocks' timed recomputes (saving_scale)."""
        if replace and self.trials:
            self.trials.pop()
        self._adopt(choices, 1.0)
        self.prediction = prediction
        self.history.append(dict(self._summary(), kept_blocks=kept,
                                 timed_saving_ms=timed_saving_ms))
        log.info("glake.swap: trying whole blocks: %d of %d run as written, the rest "
                 "recomputed (predicted %.1f ms)", len(kept), len(self.blocks),
                 prediction.step_ns / 1e6)
        self.trials.append(Trial(self.history[-1], choices, self.decisions, self.prediction,
                                 1.0, whole_blocks=True))

    def _try_whole_blocks(self, replace=False):
        """Starts trying the whole-block plan for the goal (see _whole_block_plan), in place
        of the trial under way with `replace`; False when there is none to try."""
        plan = self._whole_block_plan()
        if plan is None:
            return False
        self._start_whole_blocks(*plan, replace=replace)
        return True

    def _full_recompute_choices(self):
        """Every block recomputed, and (under the "memory" preference) every optimizer state
        moved: the least memory the executor can run in."""
        out = []
        for t, meaning in zip(self.profile.tensors, self.meaning):
            if meaning is not None and meaning[0] == "state":
                out.append((planner.SWAP, t.uses[-1], t.uses[0])
                           if t.kind == planner.CARRIED_STATE else (planner.SWAP, 0, t.uses[0]))
            else:
                out.append((planner.RECOMPUTE if t.recompute_ns is not None else planner.KEEP,
                            0, 0))
        return out

    def _decisions(self, choices):
        """Per block, what the executor keeps and swaps (op index -> KEEP or SWAP); blocks
        with nothing moved are left out and run as written (autograd saves no more than it
        needs); a block present with no entries is recomputed in full."""
        decisions = {b: {} for b in range(len(self.blocks))}
        moved = set()
        for (action, _, _), meaning in zip(choices, self.meaning):
            if meaning is None or meaning[0] == "state":
                continue
            b, ops = meaning
            if action == planner.RECOMPUTE:
                moved.add(b)
                continue
            if action == planner.SWAP:
                moved.add(b)
            for i in ops:
                decisions[b][i] = SWAP if action == planner.SWAP else KEEP
        return {b: d for b, d in decisions.items() if b in moved}

    def _budget(self):
        """Allocated bytes a step may peak at: the target less the margin."""
        return int(self.target_bytes * (1 - self.settings.margin))

    def _goal(self, whole_blocks=False):
        """Allocated bytes the plan aims at: the budget less the correction measured steps
        asked for (and, from the planner's first plan tried where a measured plan already fits
        the budget, less the most the simulation underrated a peak by then: _resume_deferred);
        for a whole-block plan, less the error the last one's measured peak showed (its own:
        the two kinds of plan miss differently; on dense-3b the planner's plans peaked 0.9 GB
        over their prediction, whole-block plans 1.2 GB under it)."""
        if self.target_bytes is None:
            return None
        if not whole_blocks:
            return max(0, self._budget() - self.correction - self.untried_margin)
        # Never above the target less half the margin: a plan overrated by less than the last
        # one still peaks under the target.
        ceiling = int(self.target_bytes * (1 - self.settings.margin / 2))
        return max(0, min(ceiling, self._budget() - self.whole_error))

    def _summary(self):
        counts = {"keep": 0, "swap": 0, "recompute": 0}
        moved = {"swap": 0, "recompute": 0}
        for (action, _, _), t, meaning in zip(self.choices, self.profile.tensors, self.meaning):
            if meaning is None:
                continue
            name = ("keep", "swap", "recompute")[action]
            counts[name] += 1
            if name in moved:
                moved[name] += t.bytes
        p = self.prediction
        return {"target_bytes": self.target_bytes, "correction": self.correction,
                "blocks_planned": len(self.decisions), "counts": counts,
                "swapped_bytes": moved["swap"], "recomputed_bytes": moved["recompute"],
                "predicted_step_ms": p.step_ns / 1e6, "predicted_peak_bytes": p.peak_bytes,
                "compute_ms": p.compute_ns / 1e6, "baseline_peak_bytes": p.baseline_peak_bytes,
                "bandwidth_gbps": tuple(round(x * self.bandwidth_scale / 1e9, 1)
                                        for x in self.bandwidth)}

    def _measure(self, now):
        """Takes the step that just ended: in warm-up, as the time of full recomputation; in
        search, as a measurement of the plan on trial; in stable, for the report."""
        cpu_ms = (time.perf_counter() - self.step_cpu) * 1e3
        now.synchronize()
        m = Measurement(self.step_start.elapsed_time(now), self.swapper.exposed_wait_ns() / 1e6,
                        cpu_ms, torch.cuda.max_memory_reserved(self.device),
                        torch.cuda.max_memory_allocated(self.device))
        if self.phase == "warmup":
            self._warm_steps.append(m.step_ms)
            self.recompute_ms = self.warm_recompute_ms = statistics.median(self._warm_steps)
            return
        if self.phase == "stable":
            self.measured.append(m)
            factor = stable_drift(self.chosen, m, self.bandwidth[1])
            if factor is not None and self.target_bytes is not None:
                # Fed back: plan again at the bandwidth the stable step's waits imply, and
                # search from there (the plan in use stays among the candidates).
                log.info("glake.swap: a stable step waited %.1f ms for copies (its plan's "
                         "trial %.1f): planning again", m.wait_ms, self.chosen.wait_ms)
                kept = self.chosen
                kept.steps = [m]  # what the plan in use measures now
                self.bandwidth_scale = kept.bandwidth_scale * factor
                self.trials = [kept]
                self._replan()
                self.phase = "search"
            return
        trial = self.trials[-1]
        trial.seen += 1
        if trial.seen == 1 and self._times_blocks():
            # The trial's first step is not one of its measured steps (see Trial): nor are its
            # blocks' timings.
            self._block_timers, self._recompute_timers = {}, {}
        # The planner predicts allocated bytes; the allocator's cache may fill the rest of the
        # cap (that is what a cache does), so only allocated bytes over the budget correct it.
        corrected = (None if self.target_bytes is None else
                     memory_correction(self.correction, m.allocated,
                                       trial.prediction.peak_bytes, self._budget()))
        # (Full recomputation is the least the executor can do: nothing to correct.)
        if (corrected is not None and self.corrections < _MAX_CORRECTIONS
                and not trial.recompute):
            log.info("glake.swap: step peaked at %d bytes allocated, %d over the budget: "
                     "planning again", m.allocated, m.allocated - self._budget())
            self.corrections += 1
            if not trial.whole_blocks:
                self.correction = corrected
                self._replan(replace=True)
                return
            self.whole_error = peak_error(m.allocated, trial.prediction.peak_bytes,
                                          self._budget())
            self.overshot.append(trial.choices)  # never tried again
            if not self._try_whole_blocks(replace=True):
                if self.deferred is not None:
                    self.deferred = None
                    self._replan()  # the planner's plan, for its own goal
                else:
                    self._finish_search()
            return
        if trial.seen > 1:
            trial.steps.append(m)
            miss = abs(m.step_ms - trial.summary["predicted_step_ms"]) / m.step_ms
            # The planner's first plan, on its first measured step (full recomputation's and
            # whole blocks' steps are predicted from warm-up's timings, not the profile).
            first = (not (trial.whole_blocks or trial.recompute) and len(trial.steps) == 1
                     and self._planner_trials() == 1)
            if first and miss > _PROFILE_MISS:
                if not self.reprofiled:
                    log.warning("glake.swap: the plan's step measured %.1f ms against %.1f "
                                "predicted: profiling again", m.step_ms,
                                trial.summary["predicted_step_ms"])
                    self._reprofile()
                    return
        if median_settled([s.step_ms for s in trial.steps], self.settings.search_steps):
            self._trial_done(trial)

    def _trial_done(self, trial):
        """Plans again with the bandwidth the trial's waits imply, or, when its copies kept to
        the prediction or the search is over, keeps the fastest plan measured."""
        log.info("glake.swap: trial %d: %s", len(self.trials), trial.describe())
        if trial.recompute:
            if not (self.opening_recompute and self._after_opening_trial(trial)):
                self._finish_search()
            return
        if trial.whole_blocks and self._grow_whole_blocks(trial):
            return
        if trial.whole_blocks and self.deferred is not None:
            if not self._resume_deferred():
                self._finish_search()
            return
        factor = bandwidth_correction(trial, self.bandwidth[1])
        if (factor is not None and self._planner_trials() < _MAX_TRIALS
                and self.target_bytes is not None):
            self.bandwidth_scale = trial.bandwidth_scale * factor
            self._replan()
            if all(t.choices != self.trials[-1].choices for t in self.trials[:-1]):
                return
            self.trials.pop()
        if not any(t.whole_blocks for t in self.trials) and self._try_whole_blocks():
            return
        self._finish_search()

    def _planner_trials(self):
        """How many of the search's trials are the planner's plans (not full recomputation,
        not whole blocks): what _MAX_TRIALS bounds for re-plans at a corrected bandwidth."""
        return sum(not (t.recompute or t.whole_blocks) for t in self.trials)

    def _finish_search(self):
        """Keeps the fastest plan measured, or full recomputation when it ran faster. Warm-up
        measured that; when its measurement beats every plan measured, it is first measured
        again as a trial of its own, in the conditions the plans met (on the MoE benchmark,
        full recomputation kept on warm-up's measurement ran 5-38% slower than it in stable, in
        every case, and slower than the plan it had displaced in most)."""
        again = next((t for t in self.trials if t.recompute), None)
        best = fastest(self.trials, None if again is not None else self.recompute_ms,
                       self._budget() if self.target_bytes is not None else None)
        if best is None and again is None and any(t.steps for t in self.trials):
            self._start_recompute_trial()
            return
        if best is not None and best.recompute:
            best = None
        self.chosen = best
        if best is None:
            self._adopt_full_recompute()
            measured = (again.step_ms if again is not None and again.steps
                        else self.recompute_ms)
            self.history.append(dict(self._summary(), chosen="recompute",
                                     searched_step_ms=measured))
            log.info("glake.swap: stable; recomputing every block (%s ms measured) beats every "
                     "plan tried", "?" if measured is None else f"{measured:.1f}")
        else:
            self._adopt(best.choices, best.bandwidth_scale)
            self.prediction = best.prediction
            self.history.append(dict(best.summary, chosen=self.trials.index(best),
                                     searched_step_ms=best.step_ms))
            log.info("glake.swap: stable; trial %d, predicted %.1f ms, measured %.1f ms",
                     self.trials.index(best) + 1, best.summary["predicted_step_ms"],
                     best.step_ms)
        self.phase = "stable"

    def _adopt_full_recompute(self):
        """Every block recomputed from the next step on (and every optimizer state moved under
        the "memory" preference, but those step mode keeps), predicted as whole-block plans
        are, with no block kept: warm-up's measured step (the profile's op times, taken under
        the recording modes, can be far off it where the host paces the step)."""
        choices = self._full_recompute_choices()
        self._adopt(choices, 1.0)
        self.decisions = {b: {} for b in range(len(self.blocks))}
        s = self.settings
        simulated = (self._with_states_kept(choices, 1.0)
                     if self.resident_states and self.backward_step != "on"
                     else planner.simulate(self.profile, choices, *self.bandwidth,
                                           s.prefetch + 1))
        self.prediction = (simulated if self.recompute_ms is None else
                           dataclasses.replace(simulated, step_ns=int(self.recompute_ms * 1e6)))

    def _start_recompute_trial(self):
        """Starts measuring full recomputation as a trial (see _finish_search and
        _whole_blocks_first)."""
        self._adopt_full_recompute()
        self.history.append(dict(self._summary(), recompute_trial=True))
        if self.opening_recompute:
            log.info("glake.swap: recomputing every block measured %.1f ms in warm-up: timed "
                     "again first (whole-block plans are predicted from it)", self.recompute_ms)
        else:
            log.info("glake.swap: recomputing every block measured %.1f ms, faster than every "
                     "plan tried: measured again", self.recompute_ms)
        self.trials.append(Trial(self.history[-1], self.choices, self.decisions,
                                 self.prediction, 1.0, recompute=True))

    def report(self):
        """Where SmartSwap stands: phase, the plan in use and its predicted step, the plans
        the search tried with what they measured, full recomputation's measured step, and the
        stable steps measured since (search.Measurement fields)."""
        return {"phase": self.phase, "iteration": self.iteration,
                "plan": self.history[-1] if self.history else None,
                "trials": [t.describe() for t in self.trials],
                "recompute_ms": self.recompute_ms,
                "warmup_recompute_ms": self.warm_recompute_ms,
                "warmup_steps": list(self._warm_steps),
                "block_fwd_ms": self.block_fwd_ms,
                "block_recompute_ms": self.block_recompute_ms,
                "measured": [vars(m) for m in self.measured],
                "resident_state_blocks": len(self.resident_states),
                "pace": self.pace,
                "saving_scale": saving_scale(self.trials, self.recompute_ms),
                "step_in_backward": self.backward_step,
                "profile_ms": self._profile_totals(),
                "warmup_forward_ms": (sum(self.warm_block_fwd_ms) if self.warm_block_fwd_ms
                                      else None),
                "swapped_out_bytes": self.swapper.bytes_out,
                "swapped_in_bytes": self.swapper.bytes_in}

    def planning_record(self):
        """What the search planned from and what its plans measured, as plain data (JSON):
        the profile the planner saw (ops, tensors, base bytes), what each tensor stands for,
        the copy bandwidths, warm-up's timings, the budget, and each trial's choices with its
        measured steps (`resident_states`: the plan in use's); None before the profiled step.
        A plan can then be simulated again away from the device (planner.simulate on the same
        profile; in step mode, a plan that keeps some states predicts their bytes on top)."""
        if self.profile is None:
            return None
        p = self.profile
        return {"ops": [list(op) for op in p.ops],
                "tensors": [dataclasses.asdict(t) for t in p.tensors],
                "base_bytes": p.base_bytes, "meaning": self.meaning,
                "bandwidth": self.bandwidth, "prefetch": self.settings.prefetch + 1,
                "preference": self.settings.preference, "pace": self.pace,
                "recompute_ms": self.recompute_ms, "block_fwd_ms": self.block_fwd_ms,
                "block_recompute_ms": self.block_recompute_ms,
                "warmup_block_fwd_ms": self.warm_block_fwd_ms,
                "budget": self._budget() if self.target_bytes is not None else None,
                "correction": self.correction, "whole_error": self.whole_error,
                "resident_states": list(self.resident_states),
                "step_in_backward": self.backward_step,
                "trials": [dict(t.describe(), choices=t.choices,
                                predicted_peak=t.prediction.peak_bytes,
                                measured=[vars(m) for m in t.steps]) for t in self.trials],
                "chosen": (self.trials.index(self.chosen) if self.chosen in self.trials
                           else None)}

    def _profile_totals(self):
        """The profiled step as the planner saw it: milliseconds of the blocks' forwards, what
        runs between the last forward and the first backward (the head), the backwards, and
        what follows them (the optimizer step)."""
        if self.profile is None:
            return None
        names = {planner.FORWARD: "forward", planner.OTHER: "head",
                 planner.BACKWARD: "backward", planner.OPTIMIZER: "optimizer"}
        totals = dict.fromkeys(names.values(), 0.0)
        for ns, phase in self.profile.ops:
            totals[names[phase]] += ns / 1e6
        return totals


def _resident_choices(carried, n):
    """The sets of `n` carried states (`carried`: blocks, first needed first) a whole-block
    plan weighs keeping: the first needed, and `n` spread evenly over the backward."""
    first = frozenset(carried[:n])
    if n == 0 or n == len(carried):
        return [first]
    # (With fewer than all, the middles of n equal shares are never the first n.)
    return [first, frozenset(carried[int((i + 0.5) * len(carried) / n)] for i in range(n))]


def apply(model, blocks=None, optimizer=None, **settings):
    """Plans `model`'s repeated blocks (or the given `blocks`) for the target in `settings`
    (see Settings; unset ones come from GLAKE_SWAP_*). Returns the SmartSwap object. Under the
    "memory" preference, `optimizer` (else the first optimizer seen stepping the blocks'
    parameters, from its second step on) has its states planned and its step run block by
    block."""
    return SmartSwap(blocks if blocks is not None else find_blocks(model),
                     Settings.from_env(**settings), optimizer=optimizer)


_auto = {"hook": None, "settings": None, "applied": None}


def enable_auto(**settings):
    """Plans the first model whose forward runs with gradients and holds repeated blocks, from
    now on (what glake.torch.enable(swap=...) calls)."""
    _auto["settings"] = Settings.from_env(**settings)
    _auto["applied"] = None
    if _auto["hook"] is not None:
        return

    def pre_hook(module, args):
        if _auto["applied"] is not None or not torch.is_grad_enabled() or not module.training:
            return
        try:
            blocks = find_blocks(module)
        except ValueError:
            return
        _auto["applied"] = SmartSwap(blocks, _auto["settings"])
        _auto["hook"].remove()
        _auto["hook"] = None
        log.info("glake.swap: planning %d blocks of %s", len(blocks), type(module).__name__)

    _auto["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)


def active():
    """The SmartSwap that enable_auto() applied, if any."""
    return _auto["applied"]
