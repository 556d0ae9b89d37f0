"""SmartSwap's search decisions (glake/swap/search.py), without torch: which plan a search keeps
and how measured waits correct the planner's bandwidth."""
import importlib.util
import pathlib
from types import SimpleNamespace

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "glake" / "swap" / "search.py"
_SPEC = importlib.util.spec_from_file_location("glake_swap_search", _PATH)
search = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(search)

GB = 10**9


def trial(steps_ms, wait_ms=0.0, predicted_wait_ms=0.0, swapped=0, scale=1.0):
    t = search.Trial(summary={"predicted_step_ms": 100.0, "swapped_bytes": swapped,
                              "recomputed_bytes": 0},
                     choices=[], decisions={},
                     prediction=SimpleNamespace(exposed_wait_ns=int(predicted_wait_ms * 1e6)),
                     bandwidth_scale=scale)
    t.steps = [search.Measurement(ms, wait_ms, ms / 2, 0, 0) for ms in steps_ms]
    return t


def test_fastest_measured_trial_wins():
    slow, fast = trial([120, 130, 125]), trial([110, 100, 105])
    assert search.fastest([slow, fast], None) is fast
    assert search.fastest([slow, fast], 111.0) is fast  # median 105 beats recomputing


def test_full_recomputation_wins_when_every_plan_ran_slower():
    assert search.fastest([trial([120, 130, 125]), trial([110, 112, 111])], 108.0) is None


def test_an_unmeasured_search_keeps_its_last_plan_unless_recomputation_was_measured():
    first, last = trial([]), trial([])
    assert search.fastest([first, last], None) is last
    assert search.fastest([first, last], 100.0) is None
    assert search.fastest([], None) is None


def test_a_trial_that_peaked_over_the_budget_is_kept_only_if_every_one_did():
    fast, slow = trial([100, 100]), trial([120, 120])
    for m in fast.steps:
        m.allocated = 1_100
    for m in slow.steps:
        m.allocated = 900
    assert search.fastest([fast, slow], None, budget=1_000) is slow
    assert search.fastest([fast, slow], None) is fast  # no budget: time alone
    for m in slow.steps:
        m.allocated = 1_050
    assert search.fastest([fast, slow], None, budget=1_000) is fast


def test_waits_as_predicted_leave_the_bandwidth_alone():
    assert search.bandwidth_correction(trial([100], wait_ms=5, predicted_wait_ms=4.5,
                                             swapped=5 * GB), 50 * GB) is None
    assert search.bandwidth_correction(trial([100], wait_ms=50), 50 * GB) is None  # no swaps


def test_longer_waits_imply_the_bandwidth_that_would_have_made_them():
    # 5 GB at 50 GB/s is 100 ms of copies; 25 ms of unpredicted waits mean 125 ms: 0.8 of it.
    t = trial([200], wait_ms=30, predicted_wait_ms=5, swapped=5 * GB)
    assert search.bandwidth_correction(t, 50 * GB) == pytest.approx(0.8)
    # Measured under a scaled bandwidth already: the copies were planned at that bandwidth.
    t = trial([200], wait_ms=30, predicted_wait_ms=5, swapped=5 * GB, scale=0.5)
    assert search.bandwidth_correction(t, 50 * GB) == pytest.approx(200 / 225)


def test_the_correction_is_bounded():
    huge = trial([1000], wait_ms=900, swapped=1 * GB)
    assert search.bandwidth_correction(huge, 50 * GB) == search.MIN_BANDWIDTH_SCALE
    small = trial([1000], wait_ms=10.5, swapped=100 * GB)
    assert search.bandwidth_correction(small, 50 * GB) == pytest.approx(0.9)


def test_a_stable_step_that_waits_longer_than_its_trial_asks_for_less_bandwidth():
    t = trial([200, 200], wait_ms=5, predicted_wait_ms=5, swapped=5 * GB)
    same = search.Measurement(200, 6, 100, 0, 0)
    assert search.stable_drift(t, same, 50 * GB) is None  # within the tolerance
    noisy = search.Measurement(210, 15, 100, 0, 0)  # 10 ms more: within 5% of the step
    assert search.stable_drift(t, noisy, 50 * GB) is None
    slower = search.Measurement(230, 30, 100, 0, 0)
    assert search.stable_drift(t, slower, 50 * GB) == pytest.approx(100 / 125)
    assert search.stable_drift(None, slower, 50 * GB) is None  # recomputing: nothing to move
    assert search.stable_drift(trial([200], swapped=0), slower, 50 * GB) is None


def test_whole_blocks_are_kept_by_time_saved_per_byte_while_they_fit():
    saving = [10.0, 30.0, 20.0, 0.0]
    sizes = [100, 100, 400, 10]
    budget = 250
    asked = []

    def fits(kept):
        asked.append(kept)
        return sum(sizes[b] for b in kept) <= budget

    # Block 1 saves most per byte, then 0; block 2 would overrun the budget; block 3 saves
    # nothing and is never asked about.
    assert search.blocks_to_keep(saving, sizes, fits) == [0, 1]
    assert asked == [[1], [0, 1], [0, 1, 2]]
    # A block that does not fit does not end the search: a smaller one after it may.
    assert search.blocks_to_keep([5.0, 50.0, 1.0], [100, 1000, 10], lambda k: 1 not in k) == [0, 2]
    assert search.blocks_to_keep(saving, sizes, lambda k: False) == []


def test_a_plan_not_tried_is_worth_a_trial_only_when_predicted_faster_than_any_measured():
    predicted = 90.0
    assert search.worth_trying(predicted, [], None), "nothing measured yet"
    assert search.worth_trying(predicted, [trial([100, 101])], 120.0)
    assert not search.worth_trying(predicted, [trial([85, 88])], 120.0), "a trial ran faster"
    assert not search.worth_trying(predicted, [trial([100])], 89.0), "recomputing ran faster"
    assert search.worth_trying(predicted, [trial([])], None), (
        "unmeasured trials count for nothing")


def test_a_fixed_miss_of_the_peak_is_corrected_once():
    """Plans aim at the budget less the correction, each one predicted at or under its aim,
    and peak `miss` bytes over their prediction. The first step over the budget corrects by
    the miss, and the plan made for that goal keeps to the budget, so nothing is corrected
    again; a plan far enough under its aim never goes over."""
    budget, miss = 28_000, 880
    for under_goal in (0, 67, 500):
        # Plans come in under their goal by `under_goal` (a plan moves whole tensors).
        correction, corrections = 0, []
        for _ in range(3):
            predicted = budget - correction - under_goal
            new = search.memory_correction(correction, predicted + miss, predicted, budget)
            if new is None:
                break
            corrections.append(new)
            correction = new
        assert corrections == ([miss] if under_goal < miss else []), under_goal
    assert search.memory_correction(0, budget, budget - 10, budget) is None
    # At least what the step went over, even when its prediction was over the budget itself.
    assert search.memory_correction(100, budget + 5, budget - 95, budget) == 105
    assert search.memory_correction(100, budget + 5, budget + 50, budget) == 105


def test_forwards_the_profiling_slowed_are_brought_to_warmups():
    limit = search.PROFILE_SLOWED
    timed = [50, 100 * limit, 100, 200, 0, 30]
    profiled = [100, 100, 100, 100, 100, 0]
    # Half: brought down; at the limit or slower: kept; never made slower; missing: kept.
    assert search.forward_scales(timed, profiled) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_a_plans_peak_error_is_what_it_measured_over_its_prediction_bounded_below():
    budget = 100_000
    assert search.peak_error(90_000, 95_000, budget) == -5_000
    assert search.peak_error(101_000, 95_000, budget) == 6_000
    assert search.peak_error(0, 95_000, budget) == -int(search.MAX_OVERRATE * budget)


def test_room_is_left_only_beyond_the_slack_and_by_the_highest_step():
    budget = 100_000
    t = trial([10, 10])
    t.steps[0].allocated, t.steps[1].allocated = 90_000, 95_000
    assert search.room_left(t, budget) == 5_000
    t.steps[1].allocated = 99_000  # within GROW_SLACK of the budget
    assert search.room_left(t, budget) == 0
    assert search.room_left(trial([]), budget) == 0


def test_the_profile_is_paced_by_warmups_measured_step_within_bounds():
    assert search.pace_factor(321.0, 300.0) == pytest.approx(1.07)
    assert search.pace_factor(250.0, 300.0) == search.MIN_PACE  # a disturbed profile
    assert search.pace_factor(900.0, 300.0) == search.MAX_PACE  # paced by the host
    assert search.pace_factor(None, 300.0) == 1.0 and search.pace_factor(321.0, 0) == 1.0


def test_a_profile_slower_than_warmup_is_disturbed():
    assert not search.profile_disturbed(321.0, 300.0)
    assert not search.profile_disturbed(290.0, 300.0)  # within DISTURBED_PACE
    assert search.profile_disturbed(380.0, 455.0)  # the dense-3b profile of 375 ms
    assert not search.profile_disturbed(None, 300.0) and not search.profile_disturbed(321.0, 0)


def test_a_trial_measures_until_its_median_is_sure_within_bounds():
    least = 3
    assert not search.median_settled([100.0, 101.0], least)  # fewer than the least
    assert search.median_settled([100.0, 101.0, 99.0], least)  # a dense model's steps
    # The MoE benchmark's steps of one process: three leave the median unsure by a tenth.
    moe = [221.4, 195.2, 191.1, 188.0, 158.7, 156.5, 153.7, 148.5, 144.8, 153.9]
    assert not search.median_settled(moe[:3], least)
    assert not search.median_settled(moe[:8], least)
    assert search.median_settled(moe[:search.MAX_TRIAL_STEPS_FACTOR * least], least)
    # Spread steps followed by steady ones: sure once enough agree.
    steps = [100.0, 110.0, 90.0, 100.0, 101.0, 100.0, 99.0, 100.0]
    assert not search.median_settled(steps[:3], least)
    assert search.median_settled(steps, least)
    assert search.median_settled([100.0], 1)  # one step asked for: no spread to go by


def test_the_simulations_largest_underrating_is_taken_from_measured_trials():
    def measured(predicted, peak):
        t = trial([10] if peak is not None else [])
        t.prediction = SimpleNamespace(peak_bytes=predicted, exposed_wait_ns=0)
        for m in t.steps:
            m.allocated = peak
        return t
    # The MoE benchmark at a 50% cap: full recomputation 0.29 GB over its simulated peak,
    # two whole-block plans 0.26 and 0.45 GB under theirs (not counted); an unmeasured plan
    # counts not.
    trials = [measured(5.307 * GB, 5.601 * GB), measured(7.629 * GB, 7.367 * GB),
              measured(8.402 * GB, 7.955 * GB), measured(8.389 * GB, None)]
    assert search.peak_underrating(trials) == pytest.approx(0.294 * GB)
    assert search.peak_underrating(trials[1:]) == 0
    assert search.peak_underrating([]) == 0


def test_a_step_is_host_paced_where_the_profiling_slowed_the_forwards_by_half_in_all():
    ms = 1_000_000
    # The MoE benchmark's profiles: forwards 2.0-5.5 times warm-up's; dense models: as timed.
    assert search.host_paced([1 / 2.4] * 12, [7 * ms] * 12)
    assert search.host_paced([1 / 1.6] * 12, [7 * ms] * 12)
    assert not search.host_paced([1.0] * 22, [5 * ms] * 22)
    assert not search.host_paced([0.81, 0.86, 1.0], [5 * ms] * 3)  # a few blocks, a little
    assert not search.host_paced([], [])
    # Taken all together, whatever the median block: five blocks of twelve slowed fourfold
    # (the median block not slowed) are 1.45 times in all, under the bar; six are 1.6, over it.
    scales = [0.25] * 5 + [1.0] * 7
    assert search.profiling_slowdown(scales, [8 * ms] * 12) == pytest.approx(96 / 66)
    assert not search.host_paced(scales, [8 * ms] * 12)
    assert search.host_paced([0.25] * 6 + [1.0] * 6, [8 * ms] * 12)  # 96 / 60
    # The blocks' own lengths weigh: one long block slowed counts more than a short one.
    assert search.profiling_slowdown([0.5, 1.0], [10 * ms, 2 * ms]) == pytest.approx(12 / 7)


def test_whole_block_savings_are_scaled_by_what_their_trials_measured():
    def whole(steps_ms, timed_saving_ms):
        t = trial(steps_ms)
        t.whole_blocks = True
        t.summary["timed_saving_ms"] = timed_saving_ms
        return t

    # Nothing measured yet (or no full recomputation to measure from): the timings stand.
    assert search.saving_scale([], 300.0) == 1.0
    assert search.saving_scale([whole([], 20.0)], 300.0) == 1.0
    assert search.saving_scale([whole([250.0], 20.0)], None) == 1.0
    # Not a whole-block trial: nothing to learn from.
    assert search.saving_scale([trial([250.0])], 300.0) == 1.0
    # 50 ms saved for 20 timed, then 60 for 40: 110 for 60 in all.
    scale = search.saving_scale([whole([250.0], 20.0), whole([240.0], 40.0)], 300.0)
    assert scale == pytest.approx(110 / 60)
    # Bounded: a noisy trial slower than full recomputation, or one far faster.
    assert search.saving_scale([whole([310.0], 20.0)], 300.0) == search.MIN_SAVING_SCALE
    assert search.saving_scale([whole([150.0], 20.0)], 300.0) == search.MAX_SAVING_SCALE
