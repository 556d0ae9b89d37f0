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
the bandwidth it showed and searches from there). The largest block input shapes seen are
planned: smaller ones run under that plan, unmeasured; a larger one sends it back to warm-up,
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
from .search import Trial, pace_factor, profile_disturbed, profiling_slowdown, saving_scale
from .states import OptimizerStatesMixin, StateSwapper, state_tensors
from .trials import TrialsMixin

log = logging.getLogger("glake.swap")
_STABLE_EVERY = 20  # stable steps between two measured ones (measuring waits for the GPU)
_WARMUP_STEPS = 4  # before the profiled step: the first pays one-time costs (optimizer
# states, library handles, the allocator's first growth) that would inflate the profile; the
# others are measured as full recomputation (their median: on the host-paced MoE benchmark
# one such step read 238-455 ms where the steps after it ran 245-390)
_WARMUP_UNMEASURED = 1
_SHAPE_CHANGES_TOLD = 3  # shape changes with no plan made that are logged as warnings
_OFF_SHAPE_STALL = 20  # steps in a row of smaller shapes, no plan made: said why once
_ENV = {"target": "GLAKE_SWAP_TARGET", "preference": "GLAKE_SWAP_PREFERENCE",
        "swap_bucket_size": "GLAKE_SWAP_BUCKET_SIZE", "prefetch": "GLAKE_SWAP_PREFETCH",
        "margin": "GLAKE_SWAP_MARGIN", "states_in_step": "GLAKE_SWAP_STATES_IN_STEP",
        "step_in_backward": "GLAKE_SWAP_STEP_IN_BACKWARD"}


@dataclass
class Settings:
    """What SmartSwap aims for. `target`: peak device memory, as bytes (> 1) or a fraction of
    the device (<= 1); None: the per-process memory fraction set in torch, else no target
    (nothing is moved). `preference`: "performance" (activations only) or "memory" (the planner
    may also move optimizer states and gradients); None (the default): "performance", unless
    the parameters, their gradients and the optimizer's states alone would take most of the
    target (states.py, _choose_preference; with no optimizer given, decided at its first
    step), then "memory" with `step_in_backward` unless that is set to False.
    `swap_bucket_size`: cheap outputs of a block are planned in buckets of at least this many
    bytes (0: one bucket per block). `prefetch`:
    blocks ahead that swap-ins start. `margin`: share of the target left for what the profile
    cannot see (allocator rounding, the copy engine's buffers). `search_steps`: the least
    measured steps per plan tried in the search (more, up to three times as many, while the
    steps leave their median unsure by more than 3%: search.median_settled).
    `states_in_step` (the "memory" preference): optimizer states
    come back only in the block-by-block optimizer step, never all at once (None: when the
    parameters, gradients and states would not fit the target together). `step_in_backward`
    (the "memory" preference; None: off, but where the default preference moves the states):
    each block's part of the optimizer step runs in the backward
    as soon as the block's gradients are complete, its states brought back just for it and
    its gradients freed after it, so the states' copies overlap the backward and the model's
    gradients are never all on the device; it turns itself on after a first step showing that
    nothing changes the gradients between backward and step (it cannot see code that only
    reads them: gradients of the blocks are None after the backward)."""
    target: float = None
    preference: str = None
    swap_bucket_size: int = 0
    prefetch: int = 1
    margin: float = 0.05
    search_steps: int = 3
    states_in_step: bool = None
    step_in_backward: bool = None

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
            value = values.get(key)
            if value is not None:  # "0" as a keyword means off, as in the environment
                values[key] = bool(float(value)) if isinstance(value, str) else bool(value)
        s = cls(**values)
        if s.preference is not None and s.preference not in planner.PREFERENCES:
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


def _within(shapes, planned):
    """Whether block inputs of `shapes` are no larger than `planned` in any dimension (a
    shorter sequence, a smaller last batch): the plan made for `planned` then keeps or swaps
    only smaller outputs of the same ops, so its peak holds for them."""
    return len(shapes) == len(planned) and all(
        len(a) == len(b) and all(x <= y for x, y in zip(a, b))
        for a, b in zip(shapes, planned))


class SmartSwap(ProfilingMixin, TrialsMixin, OptimizerStatesMixin):
    """Plans and runs the blocks of one model; see the module's documentation. Profiling lives
    in profiling.py, the search's trials and the measured steps in trials.py, the optimizer's
    side in states.py."""

    def __init__(self, blocks, settings=None, device=None, optimizer=None):
        self.blocks = list(blocks)
        # Per block the ids of its parameters, and all of them: the optimizer's steps split by.
        self._block_params = [{id(p) for p in block.parameters()} for block in self.blocks]
        self._block_param_ids = frozenset().union(*self._block_params)
        self.settings = settings or Settings.from_env()
        p = next(self.blocks[0].parameters(), None)
        self.device = torch.device(device) if device else (p.device if p is not None
                                                           else torch.device("cuda"))
        self.cuda = self.device.type == "cuda"
        self.swapper = Swapper(self.device)
        self.states = StateSwapper(self.swapper)
        self.settings = self._choose_preference(optimizer, self.settings)
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
        self.shape_changes = 0      # input shape changes since the last plan was made
        self.off_shape = False      # this step's inputs are smaller than the planned shapes
        self.plan_smaller = True    # such steps run under the plan (_check_smaller_peak)
        self.off_shape_run = 0      # such steps in a row
        self._told_within = self._told_stalled = False
        for b, block in enumerate(self.blocks):
            block.forward = self._wrap(b, block.forward)

    def remove(self):
        """Gives every block its own forward back, and the optimizer its states."""
        for block in self.blocks:
            vars(block).pop("forward", None)
        self.states.restore()
        self._unhook_optimizers()
        self._switch_to_memory = None
        self.enabled = False
        # The pinned buffers, as large as what was moved, go now (not with this object).
        self.states.host.clear()
        self.swapper.free_buffers.clear()
        self.swapper.pinned_bytes = 0

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
        self._held_grads = []  # an aborted step's: the gradients of a step already applied
        self._find_optimizer()
        self._settle_preference()
        self._new_backward_step_iteration()
        if self._restart_pending:
            self._restart_pending = False
            log.warning("glake.swap: back to warm-up: the plan counted on the optimizer step "
                        "in the backward")
            self._restart()
        sig = _shapes(args, kwargs)
        if self.off_shape:
            self._check_smaller_peak()
        off_shape = False
        if self.signature is not None and sig != self.signature:
            if self.plan_smaller and _within(sig, self.signature):
                off_shape = True
            else:
                self._tell_shapes_changed(sig)
                self._restart()
                self.signature = sig
        elif self.signature is None:
            self.signature = sig
        now = self._event()
        # (The step that ended is measured as what it was: `off_shape` is still its own.)
        if self.step_start is not None and not self.off_shape and (
                self.phase == "search"
                or (self.phase == "warmup" and self._warm_measured(self.iteration))
                or (self.phase == "stable" and self.iteration % _STABLE_EVERY == 0)):
            self._measure(now)
        self.off_shape = off_shape
        self._count_off_shape(sig)
        if self.phase == "profile" and self.marks is not None:
            self.marks.next_start = now
            self.marks.tail_peak = self._memory()[1]  # since the backward's end
            self._plan()
        elif self.off_shape:
            pass  # runs under what is there (warm-up: every block recomputed), counts for none
        elif self.phase == "warmup" and self.iteration >= _WARMUP_STEPS:
            self.phase = "profile"
            self.marks = Marks()
            if self.cuda:
                self.warm_peak = torch.cuda.max_memory_allocated(self.device)
        elif self.phase == "warmup" and self.iteration == 0 and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # warm-up's own peak, for states
        if not self.off_shape:
            self.iteration += 1
        self.step_start, self.step_cpu = now, time.perf_counter()
        # (The profiled step times its waits too: each block's are taken out of its backward.)
        measured = not self.off_shape and (self.phase in ("search", "profile") or (
            self.phase == "stable" and self.iteration % _STABLE_EVERY == 0))
        self.swapper.waits = [] if (measured and self.cuda) else None
        if self.cuda and self.phase in ("search", "stable", "profile"):
            torch.cuda.reset_peak_memory_stats(self.device)

    def _tell_shapes_changed(self, sig):
        """Logs a change to larger input shapes than the planned ones. Where they grow step
        after step no plan is made: that is said once, and the changes after it go to the
        debug log."""
        self.shape_changes += 1
        if self.shape_changes <= _SHAPE_CHANGES_TOLD:
            log.warning("glake.swap: block input shapes changed from %s to %s: back to warm-up",
                        self.signature, sig)
        else:
            log.debug("glake.swap: block input shapes changed from %s to %s: back to warm-up",
                      self.signature, sig)
        if self.shape_changes == _SHAPE_CHANGES_TOLD:
            log.warning("glake.swap: the blocks' input shapes grew %d times with no plan "
                        "made: SmartSwap plans the largest shapes seen, after %d steps of "
                        "them, and until then recomputes every block (as full checkpointing "
                        "does); pad the inputs to one length to let it plan. Further changes "
                        "are logged at debug level", self.shape_changes, _WARMUP_STEPS + 1)

    def _check_smaller_peak(self):
        """A step of smaller inputs than the planned ones ran under their plan: its kept and
        swapped outputs only shrink with the inputs, unless the block's ops allocate otherwise
        for other shapes. One that peaked over the target turns the rule off: from then on
        every new shape is planned from warm-up."""
        peak = self._step_peak() if self.phase in ("search", "stable") else None
        if peak is None or self.target_bytes is None or peak <= self.target_bytes:
            return
        log.warning("glake.swap: a step of smaller inputs than the planned %s peaked at %.2f "
                    "GiB allocated under its plan, over the %.2f GiB target: from now on every "
                    "new input shape is planned from warm-up", self.signature, peak / 2**30,
                    self.target_bytes / 2**30)
        self.plan_smaller = False

    def _step_peak(self):
        """Peak allocated bytes of the step that ended (their count starts over at each step
        of the search and stable phases); None without CUDA."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def _count_off_shape(self, sig):
        """Counts the steps of smaller shapes than the planned one in a row; where no plan is
        made yet and they go on, says once why none comes."""
        if not self.off_shape:
            self.off_shape_run = 0
            return
        self.off_shape_run += 1
        if not self._told_within:
            self._told_within = True
            log.info("glake.swap: block input shapes %s fit within the planned %s (the "
                     "largest seen): such steps run as its steps do (under its plan once made), "
                     "unmeasured", sig, self.signature)
        if (self.off_shape_run == _OFF_SHAPE_STALL and self.decisions is None
                and not self._told_stalled):
            self._told_stalled = True
            log.warning("glake.swap: none of the last %d steps had the planned input shapes "
                        "%s (the largest seen); only steps of them advance warm-up, and until "
                        "a plan is made every block is recomputed (as full checkpointing "
                        "does). Pad the inputs to one length (or a few) to let SmartSwap plan",
                        self.off_shape_run, self.signature)

    def _times_blocks(self):
        """Whether this step times each block's forward and recompute: warm-up's measured
        steps, and the steps of the search's opening trial of full recomputation (see
        _whole_blocks_first); never a step of a smaller shape than the planned one."""
        if self.off_shape:
            return False
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
            if _inside_another_checkpoint():
                self._leave_to_the_models_checkpoint(b)
                return original(*args, **kwargs)
            if b == 0:
                self._begin_iteration(args, kwargs)
            return self._run_block(b, original, args, kwargs)
        return _outside_the_compiler(forward)

    def _leave_to_the_models_checkpoint(self, b):
        """A block runs under the model's own checkpoint or saved-tensor hooks: planned inside
        them, its recomputation would meet other decisions than its forward, and stepping
        aside for some blocks would leave the per-step bookkeeping (the optimizer step in the
        backward above all) without the forward it counts on. So SmartSwap removes itself from
        the model (the blocks of this step it already ran finish under their checkpoints)."""
        log.warning("glake.swap: block %d runs under saved-tensor hooks of the model's own "
                    "(its own gradient checkpointing, or save_on_cpu): SmartSwap removes "
                    "itself and leaves the model to them; turn the model's checkpointing off "
                    "to let SmartSwap plan the blocks", b)
        self.remove()

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
        self.shape_changes = 0
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

    def report(self):
        """Where SmartSwap stands: phase, preference, the plan in use and its predicted step,
        the plans the search tried with what they measured, full recomputation's measured
        step, and the stable steps measured since (search.Measurement fields)."""
        return {"phase": self.phase, "iteration": self.iteration,
                # (A switch the optimizer's first step decided on shows before it is made.)
                "preference": ("memory" if self._switch_to_memory is not None
                               else self.settings.preference),
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
                "profiling_slowdown": profiling_slowdown(self.forward_scales,
                                                         self.profiled_fwd_ns),
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
                "profiled_fwd_ns": self.profiled_fwd_ns, "forward_scales": self.forward_scales,
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


def apply(model, blocks=None, optimizer=None, **settings):
    """Plans `model`'s repeated blocks (or the given `blocks`) for the target in `settings`
    (see Settings; unset ones come from GLAKE_SWAP_*). Returns the SmartSwap object. Under the
    "memory" preference, `optimizer` (else the one found among live objects at the first
    forward, or the first seen stepping the blocks' parameters, from that step on) has its
    states planned and its step run block by block."""
    return SmartSwap(blocks if blocks is not None else find_blocks(model),
                     Settings.from_env(**settings), optimizer=optimizer)


_COMPILER = getattr(torch, "compiler", None)  # torch.compile's public module (torch >= 2.1)


def _inside_another_checkpoint():
    """Whether a block called now runs under someone else's checkpoint: in the forward of a
    non-reentrant one (its saved-tensor hooks are set; so are save_on_cpu's), or in the
    recomputation of any in the backward (SmartSwap's own recompute calls the block's
    original forward, not the wrapped one). A reentrant checkpoint's forward runs without
    gradients, where the wrapped forward steps aside already."""
    autograd = torch._C._autograd
    hooks = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    if hooks is not None and hooks(True) is not None:
        return True
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _outside_the_compiler(fn):
    """`fn`, run by torch.compile's code as a call it does not trace (a graph break): the
    block's plan (its checkpoint with glake's dispatch modes, the timers, the copies) and the
    phase bookkeeping are Python that the compiler cannot capture. The blocks of a compiled
    model then run eagerly under their plan; the code around them stays compiled."""
    disable = getattr(_COMPILER, "disable", None)
    return fn if disable is None else disable(fn)


def _compiling():
    return bool(getattr(_COMPILER, "is_compiling", lambda: False)())


_auto = {"hook": None, "settings": None, "applied": None}


def enable_auto(**settings):
    """Plans the first model whose forward runs with gradients and holds repeated blocks, from
    now on (what glake.torch.enable(swap=...) calls)."""
    _auto["settings"] = Settings.from_env(**settings)
    _auto["applied"] = None
    if _auto["hook"] is not None:
        return

    def pre_hook(module, args):
        # (Inside a compiled region it returns at once: torch.compile calls the global hooks of
        # the compiled module itself before its code, outside the compiler.)
        if (_auto["applied"] is not None or _compiling() or not torch.is_grad_enabled()
                or not module.training):
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
