"""SmartSwap's trials of plans: how each step is measured in warm-up, search and stable
phase, which plan is tried next (full recomputation first where whole blocks can be kept, whole
blocks, the planner's plan), and which plan the search keeps. The decisions themselves (when a
median is sure, what a miss corrects, which trial ran fastest) are search.py's, free of torch.
A mixin of SmartSwap (glake/swap/__init__.py): it uses the instance's profile, settings,
planner calls and executor."""

import dataclasses
import logging
import statistics
import time

import torch

from . import planner
from .search import (Measurement, Trial, bandwidth_correction, blocks_to_keep, fastest,
                     host_paced, median_settled, memory_correction, peak_error,
                     peak_underrating, profiling_slowdown, room_left, saving_scale,
                     stable_drift, within_budget, worth_trying)

log = logging.getLogger("glake.swap")

_MAX_CORRECTIONS = 3  # re-plans a search may ask for before it keeps the plan it has
_PROFILE_MISS = 0.25  # a first plan measured this far off its prediction is profiled again
_MAX_TRIALS = 3  # plans a search tries (each corrected by the last one's measured waits)


class TrialsMixin:
    """Measuring steps and choosing the plans the search tries (see the module's
    documentation)."""

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
        # (A plan is deferred only under a target: _whole_blocks_first.)
        fitting = within_budget(self.trials, self._budget())
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


def _resident_choices(carried, n):
    """The sets of `n` carried states (`carried`: blocks, first needed first) a whole-block
    plan weighs keeping: the first needed, and `n` spread evenly over the backward."""
    first = frozenset(carried[:n])
    if n == 0 or n == len(carried):
        return [first]
    # (With fewer than all, the middles of n equal shares are never the first n.)
    return [first, frozenset(carried[int((i + 0.5) * len(carried) / n)] for i in range(n))]
