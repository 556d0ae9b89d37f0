//! The smallest memory budget a trace fits in (no OOM) under one configuration, by bisection.
//! This is the figure that matters to a user: how much device memory the workload needs.

use super::replay::{replay, ReplayOptions, ReplayResult};
use super::{NamedConfig, Result, Trace};

const MIB: usize = 1 << 20;
/// Budgets are whole mapping units (the host backend's and current GPUs' granularity).
const UNIT: usize = 2 * MIB;
/// Bisection stops at 1% of the peak live bytes or 256 MiB, whichever is finer.
const MAX_RESOLUTION: usize = 256 * MIB;

/// Outcome of a search.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSearch {
    pub trace: String,
    pub config: String,
    /// Smallest budget found with no OOM; None when not even the upper bound fits.
    pub min_budget: Option<usize>,
    /// Largest budget tried that did not fit (a lower bound).
    pub failed_below: usize,
    /// The search stopped once the bracket was this narrow.
    pub resolution: usize,
    pub replays: usize,
}

fn align_down(v: usize) -> usize {
    v / UNIT * UNIT
}

fn align_up(v: usize) -> usize {
    v.div_ceil(UNIT) * UNIT
}

/// Bisects between the peak live bytes (below which nothing fits) and the peak reserved bytes
/// of `unconstrained`, a replay of the same trace and configuration without a budget.
pub fn find_min_budget(
    trace: &Trace,
    config: &NamedConfig,
    options: &ReplayOptions,
    unconstrained: &ReplayResult,
) -> Result<BudgetSearch> {
    let live = unconstrained.peak_live_bytes as usize;
    let resolution = align_up((live / 100).clamp(UNIT, MAX_RESOLUTION));
    let mut replays = 0;
    let mut fits = |budget: usize| -> Result<bool> {
        replays += 1;
        let options = ReplayOptions {
            budget: Some(budget),
            timeline: false,
            ..*options
        };
        Ok(replay(trace, config, &options)?.ooms == 0)
    };
    // Without OOMs the pool reaches the peak live bytes, so any budget below fails.
    let mut lo = align_down(live).saturating_sub(UNIT);
    let mut hi = align_up(
        (unconstrained.peak_reserved_bytes as usize)
            .max(live)
            .max(UNIT),
    );
    // A cap changes the allocator's choices (it empties its cache sooner), so the unconstrained
    // peak is only a first guess for a budget that fits.
    let mut found = false;
    for _ in 0..4 {
        if fits(hi)? {
            found = true;
            break;
        }
        lo = hi;
        hi = align_up(hi + hi / 4);
    }
    if !found {
        return Ok(BudgetSearch {
            trace: trace.name.clone(),
            config: config.name.clone(),
            min_budget: None,
            failed_below: lo,
            resolution,
            replays,
        });
    }
    while hi - lo > resolution {
        let mid = align_down(lo + (hi - lo) / 2);
        if mid <= lo || mid >= hi {
            break;
        }
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(BudgetSearch {
        trace: trace.name.clone(),
        config: config.name.clone(),
        min_budget: Some(hi),
        failed_below: lo,
        resolution,
        replays,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{configs, read_trace};

    #[test]
    fn finds_a_budget_that_fits_and_one_below_that_does_not() {
        let mut text = String::from("alloc 1 335544320 0\nfree_completed 1 335544320 0\n");
        for i in 0..8 {
            text += &format!("alloc {} {} 0\n", 100 + i, 40 * MIB);
        }
        for i in (1..8).step_by(2) {
            text += &format!("free_completed {} {} 0\n", 100 + i, 40 * MIB);
        }
        text += &format!("alloc 200 {} 0\n", 160 * MIB);
        let trace = read_trace(text.as_bytes(), "frag", 0).unwrap();
        let options = ReplayOptions::default();
        // 2 MiB handles: the 40 MiB holes hold no whole larger handle.
        for name in ["caching", "stitch-chunk2m"] {
            let config = configs::named(name).unwrap();
            let free_run = replay(&trace, &config, &options).unwrap();
            let search = find_min_budget(&trace, &config, &options, &free_run).unwrap();
            let min = search.min_budget.unwrap();
            assert!(min - search.failed_below <= search.resolution);
            let at = |b| {
                let o = ReplayOptions {
                    budget: Some(b),
                    ..options
                };
                replay(&trace, &config, &o).unwrap().ooms
            };
            assert_eq!(at(min), 0, "{name}");
            assert!(at(search.failed_below) > 0, "{name}");
            if name == "stitch-chunk2m" {
                assert!(min <= 330 * MIB, "stitch needs only the live bytes: {min}");
            } else {
                assert!(min >= 480 * MIB, "caching needs a new segment: {min}");
            }
        }
    }
}
